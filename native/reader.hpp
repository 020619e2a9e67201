// Batched positional reads into caller-owned memory on a thread pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "thread_pool.hpp"

namespace fastload {

// A file the batch reads from: a path the reader opens (and closes), or a
// descriptor the caller owns (path empty, fd >= 0).
struct FileRef {
  std::string path;
  int fd = -1;
};

// Reads length bytes at offset of files[file] into dest. The caller has checked
// that dest has room for length bytes.
struct ReadRequest {
  std::size_t file = 0;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  std::byte* dest = nullptr;
};

class Reader {
 public:
  // chunk_bytes: large requests are split so that several threads share them.
  explicit Reader(unsigned num_threads, std::uint64_t chunk_bytes = 8u << 20);

  unsigned num_threads() const { return pool_.size(); }
  std::uint64_t chunk_bytes() const { return chunk_bytes_; }

  // Returns, for every request, the number of bytes read (less than asked at end
  // of file) or -errno of the first failure. Never throws for I/O errors.
  std::vector<std::int64_t> read(const std::vector<FileRef>& files,
                                 const std::vector<ReadRequest>& requests);

 private:
  ThreadPool pool_;
  std::uint64_t chunk_bytes_;
};

// Page-aligned (or more strictly aligned) host memory; release with free_aligned.
std::byte* alloc_aligned(std::size_t nbytes, std::size_t alignment);
void free_aligned(std::byte* ptr) noexcept;

}  // namespace fastload
