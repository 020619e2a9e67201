// Checksums of cached entries as the cache's index records them (xxh3, 64 bits), computed
// over spans of a buffer the reader filled: one call per batch, no Python per sample.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fastload {

struct Span {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

// XXH3-64 (seed 0) of data[offset, offset + length) for each span; the caller has checked
// that every span lies inside data.
std::vector<std::uint64_t> xxh3_spans(const std::byte* data, const std::vector<Span>& spans);

}  // namespace fastload
