// Tests of the JPEG batch transform without Python: run by `ctest` (native/CMakeLists.txt).
// Images are encoded here with libjpeg itself, so the tests need no files.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

// jpeglib.h needs FILE and size_t declared first.
#include <jpeglib.h>

#include "check.hpp"
#include "jpeg_transform.hpp"

namespace {

using fastload::CropJob;
using fastload::OutputSpec;
using fastload::Scratch;
using fastload_test::failures;

// Encodes width x height pixels of `components` channels (1: gray, 3: RGB, 4: CMYK).
std::vector<std::uint8_t> encode(const std::vector<std::uint8_t>& pixels, int height, int width,
                                 int components, int quality = 95, bool progressive = false) {
  jpeg_compress_struct cinfo;
  jpeg_error_mgr err;
  cinfo.err = jpeg_std_error(&err);
  jpeg_create_compress(&cinfo);
  unsigned char* out = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&cinfo, &out, &size);
  cinfo.image_width = static_cast<JDIMENSION>(width);
  cinfo.image_height = static_cast<JDIMENSION>(height);
  cinfo.input_components = components;
  cinfo.in_color_space = components == 1 ? JCS_GRAYSCALE : (components == 3 ? JCS_RGB : JCS_CMYK);
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  if (progressive) jpeg_simple_progression(&cinfo);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<std::uint8_t*>(pixels.data()) +
                   static_cast<std::size_t>(cinfo.next_scanline) * width * components;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::vector<std::uint8_t> bytes(out, out + size);
  std::free(out);
  return bytes;
}

// A smooth picture: a gradient across, another down, a third diagonal.
std::vector<std::uint8_t> gradient(int height, int width) {
  std::vector<std::uint8_t> p(static_cast<std::size_t>(height) * width * 3);
  for (int y = 0; y < height; ++y)
    for (int x = 0; x < width; ++x) {
      std::uint8_t* q = &p[(static_cast<std::size_t>(y) * width + x) * 3];
      q[0] = static_cast<std::uint8_t>(255 * x / (width - 1));
      q[1] = static_cast<std::uint8_t>(255 * y / (height - 1));
      q[2] = static_cast<std::uint8_t>(255 * (x + y) / (width + height - 2));
    }
  return p;
}

OutputSpec plain(int height, int width, bool channels_last = true) {
  return {height, width, channels_last, {0, 0, 0}, {1, 1, 1}};
}

// Runs the transform; the floats of an identity spec are the pixel values.
std::string run(const std::vector<std::uint8_t>& jpeg, CropJob job, const OutputSpec& spec,
                std::vector<float>& out) {
  job.data = jpeg.data();
  job.size = jpeg.size();
  out.assign(static_cast<std::size_t>(spec.height) * spec.width * 3, -1.0f);
  Scratch scratch;
  return fastload::transform_jpeg(job, spec, out.data(), scratch);
}

CropJob whole(int height, int width, int reduce = 1) {
  return {nullptr, 0, reduce, 0, height, 0, width, false};
}

void test_header() {
  const auto jpeg = encode(gradient(37, 53), 37, 53, 3);
  int h = 0, w = 0;
  std::string error;
  CHECK(fastload::read_jpeg_size(jpeg.data(), jpeg.size(), h, w, &error));
  CHECK(h == 37 && w == 53);
  const std::vector<std::uint8_t> junk = {'P', 'K', 3, 4, 0, 0, 0, 0};
  CHECK(!fastload::read_jpeg_size(junk.data(), junk.size(), h, w, &error));
  CHECK(!error.empty());
}

void test_constant_colour_and_normalization() {
  std::vector<std::uint8_t> pixels(48 * 64 * 3);
  for (std::size_t i = 0; i < pixels.size(); i += 3) {
    pixels[i] = 200;
    pixels[i + 1] = 100;
    pixels[i + 2] = 50;
  }
  const auto jpeg = encode(pixels, 48, 64, 3, 100);
  const OutputSpec spec{16, 16, false, {10, 20, 30}, {2, 4, 8}};
  for (int reduce : {1, 2, 4, 8}) {
    std::vector<float> out;
    const int h = (48 + reduce - 1) / reduce, w = (64 + reduce - 1) / reduce;
    CHECK(run(jpeg, whole(h, w, reduce), spec, out).empty());
    const float expect[3] = {(200 - 10) / 2.0f, (100 - 20) / 4.0f, (50 - 30) / 8.0f};
    for (int c = 0; c < 3; ++c)
      for (int k = 0; k < 16 * 16; ++k)
        CHECK(std::fabs(out[static_cast<std::size_t>(c) * 256 + k] - expect[c]) <=
              2.0f / spec.std[c]);
  }
}

void test_flip_mirrors_columns() {
  const auto jpeg = encode(gradient(40, 60), 40, 60, 3);
  std::vector<float> straight, flipped;
  CropJob job = whole(40, 60);
  CHECK(run(jpeg, job, plain(20, 30), straight).empty());
  job.flip = true;
  CHECK(run(jpeg, job, plain(20, 30), flipped).empty());
  int mismatches = 0;
  for (int y = 0; y < 20; ++y)
    for (int x = 0; x < 30; ++x)
      for (int c = 0; c < 3; ++c)
        mismatches += straight[(y * 30 + x) * 3 + c] != flipped[(y * 30 + 29 - x) * 3 + c];
  CHECK(mismatches == 0);
  CHECK(straight[0] != straight[29 * 3]);  // the picture is not symmetric
}

void test_crop_reads_the_box() {
  // Cropping at the output size is a plain crop: the pixels of the full decode's box, up to
  // chroma upsampling at the box's edges.
  const int h = 96, w = 128;
  const auto jpeg = encode(gradient(h, w), h, w, 3);
  std::vector<float> full, box;
  CHECK(run(jpeg, whole(h, w), plain(h, w), full).empty());
  const int top = 21, bottom = 70, left = 37, right = 101;
  CropJob job{nullptr, 0, 1, top, bottom, left, right, false};
  CHECK(run(jpeg, job, plain(bottom - top, right - left), box).empty());
  double total = 0;
  float worst = 0;
  for (int y = 0; y < bottom - top; ++y)
    for (int x = 0; x < right - left; ++x)
      for (int c = 0; c < 3; ++c) {
        const float d = std::fabs(box[(static_cast<std::size_t>(y) * (right - left) + x) * 3 + c] -
                                  full[(static_cast<std::size_t>(y + top) * w + x + left) * 3 + c]);
        total += d;
        worst = d > worst ? d : worst;
      }
  CHECK(worst <= 1);
  CHECK(total / ((bottom - top) * (right - left) * 3) < 0.25);
}

void test_resize_weights() {
  // 4 -> 2 across, torch's antialiased bilinear: output 0 reads pixels 0-2 with weights
  // 0.75, 0.75, 0.25 (normalized), output 1 reads pixels 1-3 with 0.25, 0.75, 0.75.
  const std::vector<std::uint8_t> row = {0,   0,   0,   0, 100, 100, 100, 0,
                                         200, 200, 200, 0, 255, 255, 255, 0};
  std::uint8_t out[8];
  Scratch scratch;
  fastload::resize_rgbx(row.data(), 1, 4, row.size(), out, 1, 2, scratch);
  CHECK(out[0] == 71 && out[2] == 71);    // (75 + 50) / 1.75 = 71.4
  CHECK(out[4] == 209 && out[6] == 209);  // (25 + 150 + 191.25) / 1.75 = 209.3
  // Same size: a copy.
  std::uint8_t same[16];
  fastload::resize_rgbx(row.data(), 1, 4, row.size(), same, 1, 4, scratch);
  CHECK(std::equal(row.begin(), row.end(), same));
  // Upscaling keeps a constant image constant.
  const std::vector<std::uint8_t> gray(5 * 3 * 4, 77);
  std::vector<std::uint8_t> big(11 * 7 * 4);
  fastload::resize_rgbx(gray.data(), 5, 3, 12, big.data(), 11, 7, scratch);
  for (std::uint8_t v : big) CHECK(v == 77);
}

void test_broken_input_fails_with_a_reason() {
  const auto jpeg = encode(gradient(64, 64), 64, 64, 3);
  std::vector<float> out, good;
  CHECK(run(jpeg, whole(64, 64), plain(32, 32), good).empty());
  // Only the end marker missing: all pixels are there, the image is accepted unchanged.
  const std::vector<std::uint8_t> no_eoi(jpeg.begin(), jpeg.end() - 2);
  CHECK(run(no_eoi, whole(64, 64), plain(32, 32), out).empty());
  CHECK(out == good);
  // Cut in the middle of the pixel data: an error, also when the box lies in the intact part.
  const std::vector<std::uint8_t> cut(jpeg.begin(), jpeg.begin() + jpeg.size() * 2 / 3);
  CHECK(!run(cut, whole(64, 64), plain(32, 32), out).empty());
  CHECK(!run(cut, CropJob{nullptr, 0, 1, 0, 8, 0, 8, false}, plain(8, 8), out).empty());
  // Not a JPEG at all, and empty input.
  const std::vector<std::uint8_t> junk(100, 0x42);
  CHECK(!run(junk, whole(64, 64), plain(8, 8), out).empty());
  CHECK(!run({}, whole(64, 64), plain(8, 8), out).empty());
  // A box outside the decoded image, and a reduction libjpeg-turbo has no SIMD path for.
  const std::string outside =
      run(jpeg, CropJob{nullptr, 0, 2, 0, 40, 0, 8, false}, plain(8, 8), out);
  CHECK(outside.find("outside") != std::string::npos);
  CHECK(!run(jpeg, whole(64, 64, 3), plain(8, 8), out).empty());
}

// Offsets of the start-of-scan markers (0xFF 0xDA appears nowhere else: 0xFF is stuffed).
std::vector<std::size_t> scan_starts(const std::vector<std::uint8_t>& jpeg) {
  std::vector<std::size_t> at;
  for (std::size_t i = 0; i + 1 < jpeg.size(); ++i)
    if (jpeg[i] == 0xFF && jpeg[i + 1] == 0xDA) at.push_back(i);
  return at;
}

void test_a_progressive_jpeg_cut_between_scans_fails() {
  const auto jpeg = encode(gradient(64, 64), 64, 64, 3, 90, true);
  const auto starts = scan_starts(jpeg);
  CHECK(starts.size() > 2);
  std::vector<float> out, good;
  CHECK(run(jpeg, whole(64, 64), plain(32, 32), good).empty());
  const std::vector<std::uint8_t> no_eoi(jpeg.begin(), jpeg.end() - 2);
  CHECK(run(no_eoi, whole(64, 64), plain(32, 32), out).empty());
  CHECK(out == good);
  for (std::size_t k = 1; k < starts.size(); ++k) {
    const std::vector<std::uint8_t> cut(jpeg.begin(), jpeg.begin() + starts[k]);
    CHECK(run(cut, whole(64, 64), plain(32, 32), out).find("truncated JPEG") == 0);
  }
}

void test_a_header_claiming_too_much_fails_before_decoding() {
  auto jpeg = encode(gradient(16, 16), 16, 16, 3, 90, true);
  std::size_t sof = 0;
  while (!(jpeg[sof] == 0xFF && jpeg[sof + 1] == 0xC2)) ++sof;
  jpeg[sof + 5] = jpeg[sof + 7] = 0xFF;  // 65,500 x 65,500 (0xFFDC)
  jpeg[sof + 6] = jpeg[sof + 8] = 0xDC;
  std::vector<float> out;
  CHECK(run(jpeg, whole(8, 8, 8), plain(8, 8), out).find("claims 65500x65500") !=
        std::string::npos);
  jpeg[sof + 5] = jpeg[sof + 7] = 0x3E;  // 16,000 x 16,000 (0x3E80): under the limit, but
  jpeg[sof + 6] = jpeg[sof + 8] = 0x80;  // from a few hundred bytes
  CHECK(run(jpeg, whole(8, 8, 8), plain(8, 8), out).find("claims 16000x16000") !=
        std::string::npos);
}

void test_gray_and_cmyk() {
  std::vector<std::uint8_t> gray(32 * 32);
  for (std::size_t i = 0; i < gray.size(); ++i) gray[i] = static_cast<std::uint8_t>(i % 200);
  std::vector<float> out;
  CHECK(run(encode(gray, 32, 32, 1), whole(32, 32), plain(16, 16), out).empty());
  int unequal = 0;
  for (std::size_t k = 0; k < out.size(); k += 3)
    unequal += out[k] != out[k + 1] || out[k] != out[k + 2];
  CHECK(unequal == 0);
  // CMYK is left to the caller (Pillow converts it): an error naming the colour space.
  std::vector<std::uint8_t> cmyk(16 * 16 * 4, 90);
  CHECK(run(encode(cmyk, 16, 16, 4), whole(16, 16), plain(8, 8), out).find("CMYK") !=
        std::string::npos);
}

}  // namespace

int main() {
  test_header();
  test_constant_colour_and_normalization();
  test_flip_mirrors_columns();
  test_crop_reads_the_box();
  test_resize_weights();
  test_broken_input_fails_with_a_reason();
  test_gray_and_cmyk();
  test_a_progressive_jpeg_cut_between_scans_fails();
  test_a_header_claiming_too_much_fails_before_decoding();
  if (failures == 0) std::puts("jpeg transform tests passed");
  return failures == 0 ? 0 : 1;
}
