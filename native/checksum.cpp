#include "checksum.hpp"

#define XXH_INLINE_ALL
#include "third_party/xxhash.h"

namespace fastload {

std::vector<std::uint64_t> xxh3_spans(const std::byte* data, const std::vector<Span>& spans) {
  std::vector<std::uint64_t> out;
  out.reserve(spans.size());
  for (const Span& s : spans) out.push_back(XXH3_64bits(data + s.offset, s.length));
  return out;
}

}  // namespace fastload
