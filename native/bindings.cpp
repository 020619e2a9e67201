// fastload._native, the reader's bindings: turns plain Python values into the C++
// core's structs, holds the destination buffers for the duration of a read, and
// releases the GIL while the threads work. With jpeg_bindings.cpp, the only files that
// see Python; the rest of native/ is plain C++17.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <string>
#include <vector>

#include "checksum.hpp"
#include "gil_release.hpp"
#include "reader.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// Holds a writable, C-contiguous byte buffer exported by a Python object.
class WritableBuffer {
 public:
  WritableBuffer(nb::handle obj, std::size_t index) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) !=
        0) {
      PyErr_Clear();
      throw nb::value_error(("destination " + std::to_string(index) +
                             " must be a writable, C-contiguous buffer of bytes")
                                .c_str());
    }
    held_ = true;
    const char* fmt = view_.format == nullptr ? "B" : view_.format;
    if (view_.itemsize != 1 ||
        (std::strcmp(fmt, "B") != 0 && std::strcmp(fmt, "b") != 0 && std::strcmp(fmt, "c") != 0)) {
      throw nb::value_error(("destination " + std::to_string(index) +
                             " must hold bytes (uint8), got format '" + fmt + "'")
                                .c_str());
    }
  }
  ~WritableBuffer() {
    if (held_) PyBuffer_Release(&view_);
  }
  WritableBuffer(WritableBuffer&& other) noexcept : view_(other.view_), held_(other.held_) {
    other.held_ = false;
  }
  WritableBuffer(const WritableBuffer&) = delete;
  WritableBuffer& operator=(const WritableBuffer&) = delete;
  WritableBuffer& operator=(WritableBuffer&&) = delete;

  std::byte* data() const { return static_cast<std::byte*>(view_.buf); }
  std::uint64_t size() const { return static_cast<std::uint64_t>(view_.len); }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

using RequestTable =
    nb::ndarray<const std::int64_t, nb::shape<-1, 5>, nb::c_contig, nb::device::cpu>;
using Int64Array = nb::ndarray<nb::numpy, std::int64_t, nb::ndim<1>>;
using ByteArray = nb::ndarray<nb::numpy, std::uint8_t, nb::ndim<1>>;

Int64Array read_batch(fastload::Reader& reader, const nb::list& files, const nb::list& dests,
                      const RequestTable& table) {
  std::vector<fastload::FileRef> refs;
  refs.reserve(files.size());
  for (nb::handle f : files) {
    if (nb::isinstance<nb::str>(f)) {
      refs.push_back({nb::cast<std::string>(f), -1});
    } else if (nb::isinstance<nb::int_>(f)) {
      const int fd = nb::cast<int>(f);
      if (fd < 0)
        throw nb::value_error(("file descriptor must be >= 0, got " + std::to_string(fd)).c_str());
      refs.push_back({std::string(), fd});
    } else {
      throw nb::type_error("each file must be a str path or an int file descriptor");
    }
  }
  std::vector<WritableBuffer> buffers;
  buffers.reserve(dests.size());
  for (std::size_t i = 0; i < dests.size(); ++i) buffers.emplace_back(dests[i], i);

  // Every request is checked before any is read, so a bad one writes nothing.
  const std::size_t n = table.shape(0);
  std::vector<fastload::ReadRequest> requests(n);
  auto view = table.view();
  for (std::size_t r = 0; r < n; ++r) {
    const std::int64_t file = view(r, 0), offset = view(r, 1), length = view(r, 2),
                       dest = view(r, 3), dest_offset = view(r, 4);
    const std::string where = "request " + std::to_string(r) + ": ";
    if (file < 0 || static_cast<std::size_t>(file) >= refs.size())
      throw nb::index_error((where + "file index out of range").c_str());
    if (dest < 0 || static_cast<std::size_t>(dest) >= buffers.size())
      throw nb::index_error((where + "destination index out of range").c_str());
    if (offset < 0 || length < 0 || dest_offset < 0)
      throw nb::value_error((where + "offset, length and destination offset must be >= 0").c_str());
    const WritableBuffer& buf = buffers[static_cast<std::size_t>(dest)];
    if (static_cast<std::uint64_t>(dest_offset) > buf.size() ||
        static_cast<std::uint64_t>(length) > buf.size() - static_cast<std::uint64_t>(dest_offset))
      throw nb::value_error((where + "destination holds " + std::to_string(buf.size()) +
                             " bytes, too small for " + std::to_string(length) +
                             " bytes at offset " + std::to_string(dest_offset))
                                .c_str());
    requests[r] = {static_cast<std::size_t>(file), static_cast<std::uint64_t>(offset),
                   static_cast<std::uint64_t>(length), buf.data() + dest_offset};
  }

  std::vector<std::int64_t> result;
  {
    fastload_py::GilRelease release;
    result = reader.read(refs, requests);
  }
  auto* out = new std::int64_t[n == 0 ? 1 : n];
  std::copy(result.begin(), result.end(), out);
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::int64_t*>(p); });
  return Int64Array(out, {n}, owner);
}

ByteArray aligned_empty(std::size_t nbytes, std::size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment % sizeof(void*) != 0)
    throw nb::value_error(("alignment must be a power of two multiple of " +
                           std::to_string(sizeof(void*)) + ", got " + std::to_string(alignment))
                              .c_str());
  std::byte* ptr;
  {
    fastload_py::GilRelease release;
    ptr = fastload::alloc_aligned(nbytes, alignment);
  }
  nb::capsule owner(ptr,
                    [](void* p) noexcept { fastload::free_aligned(static_cast<std::byte*>(p)); });
  return ByteArray(reinterpret_cast<std::uint8_t*>(ptr), {nbytes}, owner);
}

using SpanTable = nb::ndarray<const std::int64_t, nb::shape<-1, 2>, nb::c_contig, nb::device::cpu>;
using UInt64Array = nb::ndarray<nb::numpy, std::uint64_t, nb::ndim<1>>;

UInt64Array xxh3_spans(nb::handle data, const SpanTable& table) {
  Py_buffer view{};
  if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) {
    PyErr_Clear();
    throw nb::value_error("data must be a C-contiguous buffer");
  }
  const std::size_t n = table.shape(0);
  std::vector<fastload::Span> spans(n);
  auto rows = table.view();
  const auto size = static_cast<std::uint64_t>(view.len);
  for (std::size_t r = 0; r < n; ++r) {
    const std::int64_t offset = rows(r, 0), length = rows(r, 1);
    if (offset < 0 || length < 0 || static_cast<std::uint64_t>(offset) > size ||
        static_cast<std::uint64_t>(length) > size - static_cast<std::uint64_t>(offset)) {
      PyBuffer_Release(&view);
      throw nb::value_error(("span " + std::to_string(r) + " (" + std::to_string(offset) + ", " +
                             std::to_string(length) + ") is not inside the " +
                             std::to_string(size) + " bytes of data")
                                .c_str());
    }
    spans[r] = {static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(length)};
  }
  std::vector<std::uint64_t> sums;
  {
    fastload_py::GilRelease release;
    sums = fastload::xxh3_spans(static_cast<const std::byte*>(view.buf), spans);
  }
  PyBuffer_Release(&view);
  auto* out = new std::uint64_t[n == 0 ? 1 : n];
  std::copy(sums.begin(), sums.end(), out);
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::uint64_t*>(p); });
  return UInt64Array(out, {n}, owner);
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "fastload's native core: batched pread on a thread pool, aligned host buffers.";

  nb::class_<fastload::Reader>(m, "Reader")
      .def(nb::init<unsigned, std::uint64_t>(), "num_threads"_a, "chunk_bytes"_a = 8u << 20,
           "A pool of num_threads threads serving batches of reads.")
      .def_prop_ro("num_threads", &fastload::Reader::num_threads)
      .def_prop_ro("chunk_bytes", &fastload::Reader::chunk_bytes)
      .def("read", &read_batch, "files"_a, "dests"_a, "requests"_a,
           "Reads requests (rows of file index, offset, length, destination index, destination\n"
           "offset) into the destinations with the GIL released. Returns bytes read per request\n"
           "or -errno.");

  m.def("xxh3_spans", &xxh3_spans, "data"_a, "spans"_a,
        "XXH3-64 of data[offset:offset + length] for each row (offset, length) of spans, with\n"
        "the GIL released: the checksums the cache's index records, for a batch at once.");

  m.def("prepare_exit", &fastload_py::prepare_exit, "timeout_ms"_a = 1000,
        "At interpreter exit (an atexit hook): a call of this module that returns from here on\n"
        "parks its thread instead of taking the GIL back while Python finalizes.");

  m.def("aligned_empty", &aligned_empty, "nbytes"_a, "alignment"_a = 4096,
        "An uninitialized uint8 numpy array whose data starts on an alignment boundary.");
}
