// Decode, crop, resize, flip and normalize one JPEG into a row of a float32 batch, with
// libjpeg-turbo and no Python: the per-sample work of fastload's CPU decode path for the
// train and eval presets. The crop box and flip come from the caller (Python draws them
// from (seed, epoch, index), the same for every backend); this file only applies them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fastload {

// The frame size from a JPEG's header, without decoding. False (and why in *error) when
// libjpeg cannot read the header.
bool read_jpeg_size(const std::uint8_t* data, std::size_t size, int& height, int& width,
                    std::string* error);

struct CropJob {
  const std::uint8_t* data;
  std::size_t size;
  int reduce;  // DCT scaling: decode at ceil(size / reduce); 1, 2, 4 or 8
  // The box in the decoded (scaled) image's pixels: rows [top, bottom), columns [left, right).
  int top, bottom, left, right;
  bool flip;
};

struct OutputSpec {
  int height, width;
  bool channels_last;  // (H, W, 3) rows instead of (3, H, W)
  float mean[3];       // on 0-255 values: (x - mean) / std, as the Python path computes it
  float std[3];
};

// Buffers one thread reuses from sample to sample (no allocation per image once warm).
struct Scratch {
  std::vector<std::uint8_t> rows;     // the decoded crop, RGBX
  std::vector<std::uint8_t> across;   // after the horizontal pass
  std::vector<std::uint8_t> resized;  // after the vertical pass
  std::vector<std::int32_t> weights;  // fixed-point filter taps
  std::vector<std::int32_t> sums;     // one output row of the vertical pass
  std::vector<int> starts, counts;    // first source pixel and tap count per output pixel
};

// Writes job's image into out (spec.height * spec.width * 3 floats). Returns "" on success,
// else what libjpeg or the box check said; then out is untouched or partly written and the
// caller decodes the sample another way (or names it in an error). Every libjpeg warning is
// a failure (corrupt data would come back with gray or garbage rows), except a missing final
// end-of-image marker when all pixel data is present; so is a file cut between two scans
// (progressive, multi-scan) and a header claiming more pixels than the limit or than the
// file's bytes could hold.
std::string transform_jpeg(const CropJob& job, const OutputSpec& spec, float* out,
                           Scratch& scratch);

// Antialiased bilinear resize of RGBX uint8 pixels (4 bytes each; as torch's interpolate(
// mode="bilinear", antialias=True, align_corners=False) and Pillow's BILINEAR reduce):
// separable, the pass that shrinks rows first, each pass rounded to uint8. Exposed for the
// tests.
void resize_rgbx(const std::uint8_t* src, int src_h, int src_w, std::size_t src_stride,
                 std::uint8_t* dst, int dst_h, int dst_w, Scratch& scratch);

}  // namespace fastload
