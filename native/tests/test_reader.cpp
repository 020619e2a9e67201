// Tests of the native core without Python: run by `ctest` (see native/CMakeLists.txt).
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "checksum.hpp"
#include "reader.hpp"

namespace {

using fastload_test::failures;

std::string make_file(const std::vector<std::byte>& content) {
  char name[] = "/tmp/fastload_test_XXXXXX";
  const int fd = ::mkstemp(name);
  std::size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n <= 0) std::abort();
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return name;
}

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

void test_random_reads_match_file(unsigned threads, std::uint64_t chunk) {
  const auto content = pattern(1 << 20, 1);
  const std::string path = make_file(content);
  fastload::Reader reader(threads, chunk);
  std::mt19937_64 rng(threads * 7 + chunk);
  std::vector<fastload::ReadRequest> reqs;
  std::vector<std::vector<std::byte>> dests;
  dests.reserve(2000);  // no reallocation: requests point into these
  for (int i = 0; i < 2000; ++i) {
    const std::uint64_t off = rng() % (content.size() + 100);  // some past the end
    const std::uint64_t len = rng() % 5000;
    dests.emplace_back(len);
    reqs.push_back({0, off, len, dests.back().data()});
  }
  const auto result = reader.read({{path, -1}}, reqs);
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    const std::uint64_t off = reqs[i].offset;
    const std::uint64_t expect =
        off >= content.size() ? 0 : std::min<std::uint64_t>(reqs[i].length, content.size() - off);
    CHECK(result[i] == static_cast<std::int64_t>(expect));
    for (std::uint64_t k = 0; k < expect; ++k) {
      if (dests[i][k] != content[off + k]) {
        CHECK(false && "byte mismatch");
        break;
      }
    }
  }
  ::unlink(path.c_str());
}

void test_errors_are_per_request() {
  const auto content = pattern(4096, 2);
  const std::string good = make_file(content);
  fastload::Reader reader(4);
  std::vector<std::byte> a(4096), b(10), c(10), d(10);
  const auto result = reader.read(
      {{good, -1}, {"/nonexistent/fastload", -1}, {"/tmp", -1}, {"", 1 << 20}},
      {{0, 0, 4096, a.data()}, {1, 0, 10, b.data()}, {2, 0, 10, c.data()}, {3, 0, 10, d.data()}});
  CHECK(result[0] == 4096);
  CHECK(result[1] == -ENOENT);
  CHECK(result[2] == -EISDIR);
  CHECK(result[3] == -EBADF);
  ::unlink(good.c_str());
}

void test_caller_fd_stays_open() {
  const auto content = pattern(100, 3);
  const std::string path = make_file(content);
  const int fd = ::open(path.c_str(), O_RDONLY);
  fastload::Reader reader(2);
  std::vector<std::byte> dest(100);
  CHECK(reader.read({{"", fd}}, {{0, 0, 100, dest.data()}})[0] == 100);
  CHECK(::fcntl(fd, F_GETFD) != -1);  // not closed by the reader
  ::close(fd);
  ::unlink(path.c_str());
}

void test_concurrent_batches() {
  const auto content = pattern(1 << 16, 4);
  const std::string path = make_file(content);
  fastload::Reader reader(3, 1000);
  std::atomic<int> bad{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 8; ++t) {
    callers.emplace_back([&] {
      for (int round = 0; round < 50; ++round) {
        std::vector<std::byte> dest(content.size());
        const auto r = reader.read({{path, -1}}, {{0, 0, content.size(), dest.data()}});
        if (r[0] != static_cast<std::int64_t>(content.size()) || dest != content) ++bad;
      }
    });
  }
  for (auto& t : callers) t.join();
  CHECK(bad == 0);
  ::unlink(path.c_str());
}

void test_aligned_alloc() {
  for (std::size_t align : {64u, 4096u, 1u << 16}) {
    std::byte* p = fastload::alloc_aligned(12345, align);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % align == 0);
    fastload::free_aligned(p);
  }
}

// The values Python's xxhash.xxh3_64 gives (what the cache's index records).
void test_xxh3_spans_match_the_index() {
  std::vector<std::byte> data(8 + 5120);
  const char* word = "fastload";
  for (int i = 0; i < 8; ++i) data[i] = static_cast<std::byte>(word[i]);
  for (int i = 0; i < 5120; ++i) data[8 + i] = static_cast<std::byte>(i % 256);
  const auto got = fastload::xxh3_spans(data.data(), {{0, 0}, {0, 8}, {8, 5120}});
  CHECK(got.size() == 3);
  CHECK(got[0] == 0x2d06800538d394c2ULL);
  CHECK(got[1] == 0xaf0d5ff85110f150ULL);
  CHECK(got[2] == 0xf875f2fa2e99df80ULL);
}

}  // namespace

int main() {
  test_random_reads_match_file(1, 8 << 20);
  test_random_reads_match_file(4, 1000);  // small chunks: requests split across threads
  test_random_reads_match_file(0, 64);    // no workers: the caller does everything
  test_errors_are_per_request();
  test_caller_fd_stays_open();
  test_concurrent_batches();
  test_aligned_alloc();
  test_xxh3_spans_match_the_index();
  if (failures == 0) std::puts("native tests passed");
  return failures == 0 ? 0 : 1;
}
