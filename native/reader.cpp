#include "reader.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <new>

namespace fastload {
namespace {

// Linux caps a single pread at just under 2 GiB.
constexpr std::uint64_t kMaxPread = 0x7ffff000;

// One file's descriptor for the duration of a batch, opened by whichever
// chunk gets to it first and closed by whichever finishes it last.
struct OpenFile {
  std::once_flag opened;
  int fd = -1;
  int open_errno = 0;
  bool owned = false;
  std::atomic<std::size_t> chunks_left{0};
};

struct Chunk {
  std::size_t request;
  std::uint64_t offset;  // within the request
  std::uint64_t length;
};

// Fills dest from fd at offset; returns bytes read (short only at end of file) or -errno.
std::int64_t pread_full(int fd, std::byte* dest, std::uint64_t length, std::uint64_t offset) {
  std::uint64_t done = 0;
  while (done < length) {
    const std::uint64_t want = std::min(length - done, kMaxPread);
    const ssize_t got = ::pread(fd, dest + done, want, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      return -static_cast<std::int64_t>(errno);
    }
    if (got == 0) break;  // end of file
    done += static_cast<std::uint64_t>(got);
  }
  return static_cast<std::int64_t>(done);
}

}  // namespace

Reader::Reader(unsigned num_threads, std::uint64_t chunk_bytes)
    : pool_(num_threads), chunk_bytes_(chunk_bytes == 0 ? 1 : chunk_bytes) {}

std::vector<std::int64_t> Reader::read(const std::vector<FileRef>& files,
                                       const std::vector<ReadRequest>& requests) {
  std::vector<Chunk> chunks;
  chunks.reserve(requests.size());
  std::unique_ptr<OpenFile[]> open(new OpenFile[files.size()]);
  for (std::size_t r = 0; r < requests.size(); ++r) {
    const std::uint64_t length = requests[r].length;
    std::uint64_t at = 0;
    do {
      const std::uint64_t n = std::min(length - at, chunk_bytes_);
      chunks.push_back({r, at, n});
      open[requests[r].file].chunks_left.fetch_add(1, std::memory_order_relaxed);
      at += n;
    } while (at < length);
  }

  // Per-chunk results; a request's result is the sum of its chunks' bytes, or its first error.
  std::vector<std::int64_t> chunk_result(chunks.size(), 0);
  pool_.parallel_for(chunks.size(), [&](std::size_t c) {
    const Chunk& chunk = chunks[c];
    const ReadRequest& req = requests[chunk.request];
    OpenFile& file = open[req.file];
    const FileRef& ref = files[req.file];
    std::call_once(file.opened, [&] {
      if (ref.path.empty()) {
        file.fd = ref.fd;
      } else {
        file.fd = ::open(ref.path.c_str(), O_RDONLY | O_CLOEXEC);
        file.owned = file.fd >= 0;
      }
      if (file.fd < 0) file.open_errno = ref.path.empty() ? EBADF : errno;
    });
    if (file.fd < 0) {
      chunk_result[c] = -static_cast<std::int64_t>(file.open_errno);
    } else if (chunk.length > 0) {
      chunk_result[c] =
          pread_full(file.fd, req.dest + chunk.offset, chunk.length, req.offset + chunk.offset);
    }
    if (file.chunks_left.fetch_sub(1, std::memory_order_acq_rel) == 1 && file.owned) {
      ::close(file.fd);
    }
  });

  std::vector<std::int64_t> result(requests.size(), 0);
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    std::int64_t& r = result[chunks[c].request];
    if (r < 0) continue;
    r = chunk_result[c] < 0 ? chunk_result[c] : r + chunk_result[c];
  }
  return result;
}

std::byte* alloc_aligned(std::size_t nbytes, std::size_t alignment) {
  void* ptr = nullptr;
  // posix_memalign rejects a zero size on some libcs; hand out one aligned byte instead.
  if (::posix_memalign(&ptr, alignment, nbytes == 0 ? 1 : nbytes) != 0) throw std::bad_alloc();
  return static_cast<std::byte*>(ptr);
}

void free_aligned(std::byte* ptr) noexcept { std::free(ptr); }

}  // namespace fastload
