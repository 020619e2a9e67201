#include "thread_pool.hpp"

#include <algorithm>

namespace fastload {

struct ThreadPool::Job {
  Job(std::size_t n, const std::function<void(std::size_t)>& f) : count(n), fn(f) {}
  const std::size_t count;
  const std::function<void(std::size_t)>& fn;  // lives on the caller's stack until done == count
  std::atomic<std::size_t> next{0};
  std::atomic<std::size_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;
};

ThreadPool::ThreadPool(unsigned num_threads) {
  workers_.reserve(num_threads);
  for (unsigned i = 0; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::drain(Job& job) {
  for (;;) {
    const std::size_t i = job.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= job.count) return;
    job.fn(i);
    if (job.done.fetch_add(1, std::memory_order_acq_rel) + 1 == job.count) {
      std::lock_guard<std::mutex> lock(job.mutex);
      job.finished.notify_all();
    }
  }
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to serve
      job = queue_.front();
      // A job whose indices are all claimed needs no more helpers.
      if (job->next.load(std::memory_order_relaxed) >= job->count) {
        queue_.pop_front();
        continue;
      }
    }
    drain(*job);
  }
}

void ThreadPool::parallel_for(std::size_t count, const std::function<void(std::size_t)>& fn) {
  if (count == 0) return;
  auto job = std::make_shared<Job>(count, fn);
  if (count > 1 && !workers_.empty()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(job);
    }
    if (count - 1 >= workers_.size()) {
      wake_.notify_all();
    } else {
      for (std::size_t i = 0; i + 1 < count; ++i) wake_.notify_one();
    }
  }
  drain(*job);  // the caller works too instead of only waiting
  std::unique_lock<std::mutex> lock(job->mutex);
  job->finished.wait(lock, [&] { return job->done.load(std::memory_order_acquire) == count; });
  lock.unlock();
  std::lock_guard<std::mutex> queue_lock(mutex_);
  auto it = std::find(queue_.begin(), queue_.end(), job);
  if (it != queue_.end()) queue_.erase(it);
}

}  // namespace fastload
