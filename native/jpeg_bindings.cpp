// fastload._native_jpeg: the JPEG batch transform for Python. Its own module, so the core
// (_native) loads where libjpeg-turbo's library is missing. One call per batch: the GIL is
// released while the pool's threads decode, crop, resize, flip and normalize every sample.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gil_release.hpp"
#include "jpeg_transform.hpp"
#include "thread_pool.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// The bytes of each image (bytes, memoryview, numpy: any C-contiguous buffer), held while
// the threads read them.
class Images {
 public:
  explicit Images(const nb::list& images) {
    views_.reserve(images.size());
    for (std::size_t i = 0; i < images.size(); ++i) {
      Py_buffer view;
      if (PyObject_GetBuffer(images[i].ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        throw nb::type_error(
            ("image " + std::to_string(i) + " must be bytes or a C-contiguous buffer").c_str());
      }
      views_.push_back(view);
    }
  }
  ~Images() {
    for (Py_buffer& view : views_) PyBuffer_Release(&view);
  }
  Images(const Images&) = delete;
  Images& operator=(const Images&) = delete;

  std::size_t size() const { return views_.size(); }
  const std::uint8_t* data(std::size_t i) const {
    return static_cast<const std::uint8_t*>(views_[i].buf);
  }
  std::size_t length(std::size_t i) const { return static_cast<std::size_t>(views_[i].len); }

 private:
  std::vector<Py_buffer> views_;
};

using Sizes = nb::ndarray<nb::numpy, std::int32_t, nb::shape<-1, 2>>;
using Boxes = nb::ndarray<const std::int32_t, nb::shape<-1, 6>, nb::c_contig, nb::device::cpu>;
using Batch = nb::ndarray<float, nb::c_contig, nb::device::cpu>;

class JpegTransform {
 public:
  explicit JpegTransform(unsigned num_threads)
      : pool_(std::make_unique<fastload::ThreadPool>(num_threads > 0 ? num_threads - 1 : 0)),
        num_threads_(num_threads > 0 ? num_threads : 1),
        owner_(::getpid()) {}
  ~JpegTransform() {
    // In a forked child the pool's threads do not exist: joining them would hang forever,
    // so the child leaves the parent's pool alone (the child makes its own).
    if (::getpid() != owner_) static_cast<void>(pool_.release());
  }
  JpegTransform(const JpegTransform&) = delete;
  JpegTransform& operator=(const JpegTransform&) = delete;

  unsigned num_threads() const { return num_threads_; }

  Sizes sizes(const nb::list& images) {
    Images bytes(images);
    const std::size_t n = bytes.size();
    auto* out = new std::int32_t[n * 2 + 2];
    {
      fastload_py::GilRelease release;
      pool_->parallel_for(n, [&](std::size_t i) {
        int h = -1, w = -1;
        if (!fastload::read_jpeg_size(bytes.data(i), bytes.length(i), h, w, nullptr)) h = w = -1;
        out[2 * i] = h;
        out[2 * i + 1] = w;
      });
    }
    nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<std::int32_t*>(p); });
    return Sizes(out, {n, 2}, owner);
  }

  std::vector<std::pair<std::size_t, std::string>> run(const nb::list& images, const Boxes& boxes,
                                                       Batch& out, int height, int width,
                                                       bool channels_last,
                                                       const std::vector<float>& mean,
                                                       const std::vector<float>& std) {
    Images bytes(images);
    const std::size_t n = bytes.size();
    if (boxes.shape(0) != n)
      throw nb::value_error(
          ("got " + std::to_string(n) + " images but " + std::to_string(boxes.shape(0)) + " boxes")
              .c_str());
    if (height <= 0 || width <= 0) throw nb::value_error("height and width must be > 0");
    if (mean.size() != 3 || std.size() != 3)
      throw nb::value_error("mean and std need 3 values each");
    const std::size_t per_image = static_cast<std::size_t>(height) * width * 3;
    if (out.ndim() == 0 || out.shape(0) != n || out.size() != n * per_image)
      throw nb::value_error(("out must hold " + std::to_string(n) + " images of " +
                             std::to_string(per_image) + " floats")
                                .c_str());
    fastload::OutputSpec spec{
        height, width, channels_last, {mean[0], mean[1], mean[2]}, {std[0], std[1], std[2]}};
    std::vector<std::string> errors(n);
    auto box = boxes.view();
    float* base = out.data();
    {
      fastload_py::GilRelease release;
      pool_->parallel_for(n, [&](std::size_t i) {
        thread_local fastload::Scratch scratch;  // reused from batch to batch
        const fastload::CropJob job{bytes.data(i), bytes.length(i), box(i, 0), box(i, 1),
                                    box(i, 2),     box(i, 3),       box(i, 4), box(i, 5) != 0};
        try {
          errors[i] = fastload::transform_jpeg(job, spec, base + i * per_image, scratch);
        } catch (const std::exception& e) {  // bad_alloc: the sample goes the other way
          errors[i] = e.what();
        }
      });
    }
    std::vector<std::pair<std::size_t, std::string>> failed;
    for (std::size_t i = 0; i < n; ++i)
      if (!errors[i].empty()) failed.emplace_back(i, std::move(errors[i]));
    return failed;
  }

 private:
  std::unique_ptr<fastload::ThreadPool> pool_;
  unsigned num_threads_;
  pid_t owner_;
};

}  // namespace

NB_MODULE(_native_jpeg, m) {
  m.doc() =
      "fastload's JPEG batch transform: libjpeg-turbo decode, crop, resize, flip, "
      "normalize on a thread pool, one call per batch with the GIL released.";

  m.def("prepare_exit", &fastload_py::prepare_exit, "timeout_ms"_a = 1000,
        "At interpreter exit (an atexit hook): a call of this module that returns from here on\n"
        "parks its thread instead of taking the GIL back while Python finalizes.");

  nb::class_<JpegTransform>(m, "JpegTransform")
      .def(nb::init<unsigned>(), "num_threads"_a,
           "A pool of num_threads threads (the calling thread is one of them).")
      .def_prop_ro("num_threads", &JpegTransform::num_threads)
      .def("sizes", &JpegTransform::sizes, "images"_a,
           "(height, width) from each JPEG's header; -1, -1 where libjpeg cannot read it.")
      .def("run", &JpegTransform::run, "images"_a, "boxes"_a, "out"_a, "height"_a, "width"_a,
           "channels_last"_a, "mean"_a, "std"_a,
           "Decodes image i at DCT scale 1/boxes[i, 0], crops rows boxes[i, 1]:boxes[i, 2] and\n"
           "columns boxes[i, 3]:boxes[i, 4], resizes to height x width (antialiased bilinear),\n"
           "flips if boxes[i, 5] and writes (x - mean) / std into out[i]. Returns (i, why)\n"
           "for the samples it could not do; their rows of out are undefined.");
}
