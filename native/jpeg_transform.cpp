#include "jpeg_transform.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

// jpeglib.h needs FILE and size_t declared first.
#include <jerror.h>
#include <jpeglib.h>

namespace fastload {
namespace {

// Fixed-point bits of a filter tap: taps fit an int16 (SSE2's multiply-add takes pairs of
// them), and the rounding error stays under 1/100 of a level.
constexpr int kPrecision = 14;
// Pixels are decoded as RGBX: four bytes each, so the resize's per-pixel arithmetic runs as
// one 4-lane vector operation instead of three scalar ones.
constexpr int kPixel = 4;
// What a header may claim before anything is allocated (as fastload.decode.limits checks it
// in Python): the full size, which a progressive JPEG's coefficients take whatever the DCT
// scale; and, past 2^24 pixels, no more than 4096 pixels per byte of the file (a complete
// Huffman-coded JPEG spends at least a bit per 8x8 block of its first component).
constexpr std::uint64_t kMaxPixels = 178'956'970;
constexpr std::uint64_t kAlwaysAllowedPixels = std::uint64_t{1} << 24;
constexpr std::uint64_t kMaxPixelsPerByte = 4096;

// libjpeg reports errors through a callback that must not return: it jumps back to the
// setjmp of the call in progress, with the message.
struct ErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void on_error(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

void on_message(j_common_ptr cinfo, int level) {
  if (level >= 0) return;  // trace messages
  // The data ran out: libjpeg goes on with an inserted end marker. Harmless when only that
  // marker was missing; missing pixel data then raises its own warning (JWRN_HIT_MARKER).
  if (cinfo->err->msg_code == JWRN_JPEG_EOF) return;
  on_error(cinfo);  // any other warning: corrupt data, decoded as gray or garbage
}

void install_handlers(jpeg_decompress_struct& cinfo, ErrorManager& err) {
  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = on_error;
  err.pub.emit_message = on_message;
  err.message[0] = '\0';
}

// Decodes rows [top, bottom) of the scaled image, columns from an iMCU boundary at or left of
// job.left through job.right, into scratch.rows. Sets the first wanted column's offset in a
// row and the row stride (bytes). A separate function: no C++ object with a destructor may
// live in a frame that longjmp leaves.
bool decode_box(const CropJob& job, Scratch& scratch, int& column, std::size_t& stride,
                ErrorManager& err) {
  jpeg_decompress_struct cinfo;
  install_handlers(cinfo, err);
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, job.data, static_cast<unsigned long>(job.size));
  jpeg_read_header(&cinfo, TRUE);
  const std::uint64_t pixels = std::uint64_t{cinfo.image_width} * cinfo.image_height;
  if (pixels > kMaxPixels ||
      (pixels > kAlwaysAllowedPixels && pixels > kMaxPixelsPerByte * job.size)) {
    std::snprintf(err.message, sizeof err.message,
                  "its header claims %ux%u pixels from %zu bytes: over the limit, not decoded",
                  cinfo.image_width, cinfo.image_height, job.size);
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    std::snprintf(err.message, sizeof err.message, "CMYK/YCCK colour space");
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  cinfo.out_color_space = JCS_EXT_RGBX;  // grayscale too: libjpeg-turbo expands it
  cinfo.scale_num = 1;
  cinfo.scale_denom = static_cast<unsigned>(job.reduce);
  jpeg_start_decompress(&cinfo);
  const int height = static_cast<int>(cinfo.output_height);
  const int width = static_cast<int>(cinfo.output_width);
  if (job.top < 0 || job.left < 0 || job.bottom > height || job.right > width ||
      job.top >= job.bottom || job.left >= job.right) {
    std::snprintf(err.message, sizeof err.message,
                  "crop box rows %d-%d, columns %d-%d outside the %dx%d decoded image", job.top,
                  job.bottom, job.left, job.right, width, height);
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  // A margin on each side: chroma upsampling at the edge of a decoded region is not what
  // it is inside the image, and the box's edge columns must come out as in a full decode.
  constexpr int kMargin = 16;
  const int from = std::max(job.left - kMargin, 0), to = std::min(job.right + kMargin, width);
  JDIMENSION x = static_cast<JDIMENSION>(from);
  JDIMENSION w = static_cast<JDIMENSION>(to - from);
  if (w < cinfo.output_width) jpeg_crop_scanline(&cinfo, &x, &w);  // widens to iMCU edges
  column = job.left - static_cast<int>(x);
  stride = static_cast<std::size_t>(cinfo.output_width) * kPixel;
  scratch.rows.resize(stride * static_cast<std::size_t>(job.bottom - job.top));
  if (job.top > 0) jpeg_skip_scanlines(&cinfo, static_cast<JDIMENSION>(job.top));
  while (cinfo.output_scanline < static_cast<JDIMENSION>(job.bottom)) {
    JSAMPROW row = scratch.rows.data() + (cinfo.output_scanline - job.top) * stride;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  // The rows below are still entropy-decoded (not transformed): skipping all the way to the
  // end would let libjpeg stop without reading them, and a truncated file would pass.
  const JDIMENSION rest = cinfo.output_height - cinfo.output_scanline;
  if (rest > 0) {
    if (rest > 1) jpeg_skip_scanlines(&cinfo, rest - 1);
    scratch.across.resize(stride);
    JSAMPROW row = scratch.across.data();
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);  // reads to the end marker: trailing corruption warns too
  jpeg_destroy_decompress(&cinfo);
  return true;
}

// Whether a JPEG lacking its end marker still holds every scan a complete image needs (as
// fastload.decode.jpeg_scans walks it in Python): libjpeg decodes one cut exactly between
// two scans without a warning. "" when complete, else what is missing.
std::string missing_scans(const std::uint8_t* d, std::size_t n) {
  if (n >= 2 && d[n - 2] == 0xFF && d[n - 1] == 0xD9) return std::string();
  std::vector<int> ids;
  std::vector<std::array<int, 64>> known;  // per component: the bit each coefficient is down to
  std::vector<bool> seen;
  bool progressive = false;
  std::size_t pos = 2;
  while (pos + 1 < n) {
    if (d[pos] != 0xFF) return "unexpected data where a marker belongs";
    const int marker = d[pos + 1];
    if (marker == 0xFF) {
      ++pos;
      continue;
    }
    if (marker == 0xD9) return std::string();
    if ((marker >= 0xD0 && marker <= 0xD8) || marker == 0x01) {
      pos += 2;
      continue;
    }
    if (pos + 4 > n) break;
    const std::size_t length = (std::size_t{d[pos + 2]} << 8) | d[pos + 3];
    const std::size_t end = pos + 2 + length;
    if (length < 2 || end > n) break;  // the file stops inside a header
    const std::uint8_t* seg = d + pos + 4;
    const std::size_t seg_len = length - 2;
    const bool sof =
        marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC;
    if (sof && seg_len >= 6) {
      progressive = marker == 0xC2 || marker == 0xC6 || marker == 0xCA || marker == 0xCE;
      ids.clear();
      for (std::size_t k = 0; k < seg[5] && 6 + 3 * k < seg_len; ++k) ids.push_back(seg[6 + 3 * k]);
      std::array<int, 64> never;
      never.fill(64);
      known.assign(ids.size(), never);
      seen.assign(ids.size(), false);
    } else if (marker == 0xDA && seg_len >= 1) {
      const std::size_t count = seg[0], tail = 1 + 2 * count;
      if (tail + 3 > seg_len) return "a scan header is cut short";
      const int ss = seg[tail], se = std::min<int>(seg[tail + 1], 63), al = seg[tail + 2] & 0x0F;
      for (std::size_t k = 0; k < count; ++k) {
        const auto at = std::find(ids.begin(), ids.end(), seg[1 + 2 * k]);
        if (at == ids.end()) continue;
        const auto c = static_cast<std::size_t>(at - ids.begin());
        seen[c] = true;
        for (int j = ss; j <= se; ++j) known[c][j] = std::min(known[c][j], al);
      }
      // The entropy-coded data: 0xFF is followed by 0x00 stuffing or RSTn inside it.
      pos = end;
      while (pos + 1 < n) {
        if (d[pos] == 0xFF) {
          const int next = d[pos + 1];
          if (next == 0xFF) {
            ++pos;
            continue;
          }
          if (next != 0x00 && !(next >= 0xD0 && next <= 0xD7)) break;
          pos += 2;
          continue;
        }
        ++pos;
      }
      continue;
    }
    pos = end;
  }
  if (ids.empty()) return "the file stops before its frame header";
  for (std::size_t c = 0; c < ids.size(); ++c) {
    if (progressive) {
      for (int bit : known[c])
        if (bit != 0) return "the file stops before the scans that complete the image";
    } else if (!seen[c]) {
      return "the file stops before the scans of some components";
    }
  }
  return std::string();
}

// Filter taps of one axis: output pixel i reads counts[i] source pixels from starts[i].
// Triangle filter widened by the scale when shrinking (antialiasing), as torch computes it.
int make_taps(int in_size, int out_size, Scratch& scratch) {
  const double scale = static_cast<double>(in_size) / out_size;
  const double support = scale >= 1.0 ? scale : 1.0;
  const double inverse = scale >= 1.0 ? 1.0 / scale : 1.0;
  const int max_taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  scratch.starts.resize(static_cast<std::size_t>(out_size));
  scratch.counts.resize(static_cast<std::size_t>(out_size));
  scratch.weights.assign(static_cast<std::size_t>(out_size) * max_taps, 0);
  double taps[64 + 1];
  std::vector<double> wide;
  double* w = taps;
  if (max_taps > 64) {
    wide.resize(static_cast<std::size_t>(max_taps));
    w = wide.data();
  }
  for (int i = 0; i < out_size; ++i) {
    const double center = scale * (i + 0.5);
    const int lo = std::max(static_cast<int>(center - support + 0.5), 0);
    const int hi = std::min(static_cast<int>(center + support + 0.5), in_size);
    const int n = std::max(hi - lo, 1);
    double total = 0;
    for (int j = 0; j < n; ++j) {
      const double x = std::fabs((j + lo - center + 0.5) * inverse);
      w[j] = x < 1.0 ? 1.0 - x : 0.0;
      total += w[j];
    }
    std::int32_t* fixed = scratch.weights.data() + static_cast<std::size_t>(i) * max_taps;
    for (int j = 0; j < n; ++j) {
      const double v = total > 0 ? w[j] / total : (j == 0 ? 1.0 : 0.0);
      fixed[j] = static_cast<std::int32_t>(std::lround(v * (1 << kPrecision)));
    }
    scratch.starts[static_cast<std::size_t>(i)] = std::min(lo, in_size - 1);
    scratch.counts[static_cast<std::size_t>(i)] = n;
  }
  return max_taps;
}

inline std::uint8_t to_byte(std::int32_t acc) {
  const std::int32_t v = acc >> kPrecision;
  return static_cast<std::uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// One output pixel of the horizontal pass: n taps from p (RGBX pixels) into o.
inline void filter_pixel(const std::uint8_t* p, const std::int32_t* w, int n, std::uint8_t* o) {
#if defined(__SSE2__)
  // Two taps per step: pixels t and t+1 interleaved as 16-bit (r0 r1 g0 g1 b0 b1 x0 x1) and
  // multiplied-added with (w0 w1) in each 32-bit lane.
  const __m128i zero = _mm_setzero_si128();
  __m128i acc = _mm_set1_epi32(1 << (kPrecision - 1));
  int t = 0;
  for (; t + 1 < n; t += 2) {
    const __m128i wide =
        _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + t * kPixel)), zero);
    const __m128i pair = _mm_unpacklo_epi16(wide, _mm_srli_si128(wide, 8));
    const __m128i taps = _mm_set1_epi32(static_cast<int>((w[t] & 0xffff) | (w[t + 1] << 16)));
    acc = _mm_add_epi32(acc, _mm_madd_epi16(pair, taps));
  }
  if (t < n) {
    std::int32_t pixel;
    std::memcpy(&pixel, p + t * kPixel, sizeof pixel);
    const __m128i one = _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(pixel), zero), zero);
    acc = _mm_add_epi32(acc, _mm_madd_epi16(one, _mm_set1_epi32(w[t] & 0xffff)));
  }
  acc = _mm_srai_epi32(acc, kPrecision);
  const __m128i bytes = _mm_packus_epi16(_mm_packs_epi32(acc, acc), zero);
  const std::int32_t packed = _mm_cvtsi128_si32(bytes);
  std::memcpy(o, &packed, sizeof packed);
#else
  std::int32_t acc[kPixel] = {};
  for (int t = 0; t < n; ++t, p += kPixel)
    for (int c = 0; c < kPixel; ++c) acc[c] += p[c] * w[t];
  for (int c = 0; c < kPixel; ++c) o[c] = to_byte(acc[c] + (1 << (kPrecision - 1)));
#endif
}

void resize_across(const std::uint8_t* src, int rows, int src_w, std::size_t src_stride,
                   std::uint8_t* dst, int dst_w, Scratch& scratch) {
  const int max_taps = make_taps(src_w, dst_w, scratch);
  for (int y = 0; y < rows; ++y) {
    const std::uint8_t* in = src + static_cast<std::size_t>(y) * src_stride;
    std::uint8_t* o = dst + static_cast<std::size_t>(y) * dst_w * kPixel;
    for (int x = 0; x < dst_w; ++x)
      filter_pixel(in + static_cast<std::size_t>(scratch.starts[x]) * kPixel,
                   scratch.weights.data() + static_cast<std::size_t>(x) * max_taps,
                   scratch.counts[x], o + x * kPixel);
  }
}

// The vertical pass: output row y is a weighted sum of counts[y] source rows from starts[y].
void resize_down(const std::uint8_t* src, int src_h, std::size_t src_stride, std::size_t row_bytes,
                 std::uint8_t* dst, int dst_h, Scratch& scratch) {
  const int max_taps = make_taps(src_h, dst_h, scratch);
  constexpr std::int32_t half = 1 << (kPrecision - 1);
  for (int y = 0; y < dst_h; ++y) {
    const std::int32_t* w = scratch.weights.data() + static_cast<std::size_t>(y) * max_taps;
    const int n = scratch.counts[y];
    const std::uint8_t* base = src + static_cast<std::size_t>(scratch.starts[y]) * src_stride;
    std::uint8_t* o = dst + static_cast<std::size_t>(y) * row_bytes;
    std::size_t k = 0;
#if defined(__SSE2__)
    // 16 bytes a step, two rows a multiply-add: bytes of rows t and t+1 interleaved as
    // 16-bit pairs against (w[t], w[t+1]).
    const __m128i zero = _mm_setzero_si128();
    for (; k + 16 <= row_bytes; k += 16) {
      __m128i acc[4] = {_mm_set1_epi32(half), _mm_set1_epi32(half), _mm_set1_epi32(half),
                        _mm_set1_epi32(half)};
      int t = 0;
      for (; t < n; t += 2) {
        const __m128i a = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(base + static_cast<std::size_t>(t) * src_stride + k));
        const bool pair = t + 1 < n;
        const __m128i b = pair ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                     base + static_cast<std::size_t>(t + 1) * src_stride + k))
                               : zero;
        const __m128i taps =
            _mm_set1_epi32(static_cast<int>((w[t] & 0xffff) | ((pair ? w[t + 1] : 0) << 16)));
        const __m128i alo = _mm_unpacklo_epi8(a, zero), ahi = _mm_unpackhi_epi8(a, zero);
        const __m128i blo = _mm_unpacklo_epi8(b, zero), bhi = _mm_unpackhi_epi8(b, zero);
        acc[0] = _mm_add_epi32(acc[0], _mm_madd_epi16(_mm_unpacklo_epi16(alo, blo), taps));
        acc[1] = _mm_add_epi32(acc[1], _mm_madd_epi16(_mm_unpackhi_epi16(alo, blo), taps));
        acc[2] = _mm_add_epi32(acc[2], _mm_madd_epi16(_mm_unpacklo_epi16(ahi, bhi), taps));
        acc[3] = _mm_add_epi32(acc[3], _mm_madd_epi16(_mm_unpackhi_epi16(ahi, bhi), taps));
      }
      for (__m128i& v : acc) v = _mm_srai_epi32(v, kPrecision);
      const __m128i bytes =
          _mm_packus_epi16(_mm_packs_epi32(acc[0], acc[1]), _mm_packs_epi32(acc[2], acc[3]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + k), bytes);
    }
#endif
    for (; k < row_bytes; ++k) {
      std::int32_t acc = half;
      for (int t = 0; t < n; ++t) acc += base[static_cast<std::size_t>(t) * src_stride + k] * w[t];
      o[k] = to_byte(acc);
    }
  }
}

}  // namespace

bool read_jpeg_size(const std::uint8_t* data, std::size_t size, int& height, int& width,
                    std::string* error) {
  jpeg_decompress_struct cinfo;
  ErrorManager err;
  install_handlers(cinfo, err);
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    if (error != nullptr) *error = err.message;
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  height = static_cast<int>(cinfo.image_height);
  width = static_cast<int>(cinfo.image_width);
  jpeg_destroy_decompress(&cinfo);
  return true;
}

void resize_rgbx(const std::uint8_t* src, int src_h, int src_w, std::size_t src_stride,
                 std::uint8_t* dst, int dst_h, int dst_w, Scratch& scratch) {
  const std::size_t dst_row = static_cast<std::size_t>(dst_w) * kPixel;
  const std::size_t src_row = static_cast<std::size_t>(src_w) * kPixel;
  if (src_w == dst_w && src_h == dst_h) {
    for (int y = 0; y < dst_h; ++y)
      std::copy_n(src + static_cast<std::size_t>(y) * src_stride, dst_row,
                  dst + static_cast<std::size_t>(y) * dst_row);
  } else if (src_h == dst_h) {
    resize_across(src, src_h, src_w, src_stride, dst, dst_w, scratch);
  } else if (src_w == dst_w) {
    resize_down(src, src_h, src_stride, dst_row, dst, dst_h, scratch);
  } else if (src_h > dst_h) {
    // Shrinking rows first leaves the (costlier) horizontal pass fewer rows to do.
    scratch.across.resize(src_row * static_cast<std::size_t>(dst_h));
    resize_down(src, src_h, src_stride, src_row, scratch.across.data(), dst_h, scratch);
    resize_across(scratch.across.data(), dst_h, src_w, src_row, dst, dst_w, scratch);
  } else {
    scratch.across.resize(dst_row * static_cast<std::size_t>(src_h));
    resize_across(src, src_h, src_w, src_stride, scratch.across.data(), dst_w, scratch);
    resize_down(scratch.across.data(), src_h, dst_row, dst_row, dst, dst_h, scratch);
  }
}

std::string transform_jpeg(const CropJob& job, const OutputSpec& spec, float* out,
                           Scratch& scratch) {
  if (job.reduce != 1 && job.reduce != 2 && job.reduce != 4 && job.reduce != 8)
    return "reduce must be 1, 2, 4 or 8, got " + std::to_string(job.reduce);
  const std::string missing = missing_scans(job.data, job.size);
  if (!missing.empty()) return "truncated JPEG: " + missing;
  int column = 0;
  std::size_t stride = 0;
  ErrorManager err;
  if (!decode_box(job, scratch, column, stride, err)) return err.message;
  const int crop_h = job.bottom - job.top, crop_w = job.right - job.left;
  const int h = spec.height, w = spec.width;
  scratch.resized.resize(static_cast<std::size_t>(h) * w * kPixel);
  resize_rgbx(scratch.rows.data() + static_cast<std::size_t>(column) * kPixel, crop_h, crop_w,
              stride, scratch.resized.data(), h, w, scratch);
  // (v - mean) / std for each of the 256 values: the same float arithmetic as the Python
  // path's, done once per channel instead of once per pixel.
  float table[3][256];
  for (int c = 0; c < 3; ++c)
    for (int v = 0; v < 256; ++v)
      table[c][v] = (static_cast<float>(v) - spec.mean[c]) / spec.std[c];
  const std::uint8_t* pixels = scratch.resized.data();
  const std::size_t plane = static_cast<std::size_t>(h) * w;
  for (int y = 0; y < h; ++y) {
    const std::uint8_t* row = pixels + static_cast<std::size_t>(y) * w * kPixel;
    const std::size_t at = static_cast<std::size_t>(y) * w;
    if (spec.channels_last) {
      float* o = out + at * 3;
      for (int x = 0; x < w; ++x) {
        const std::uint8_t* p = row + static_cast<std::size_t>(job.flip ? w - 1 - x : x) * kPixel;
        o[3 * x] = table[0][p[0]];
        o[3 * x + 1] = table[1][p[1]];
        o[3 * x + 2] = table[2][p[2]];
      }
      continue;
    }
    float* r = out + at;
    float* g = r + plane;
    float* b = g + plane;
    for (int x = 0; x < w; ++x) {
      const std::uint8_t* p = row + static_cast<std::size_t>(job.flip ? w - 1 - x : x) * kPixel;
      r[x] = table[0][p[0]];
      g[x] = table[1][p[1]];
      b[x] = table[2][p[2]];
    }
  }
  return std::string();
}

}  // namespace fastload
