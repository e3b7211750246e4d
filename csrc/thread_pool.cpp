// A small process-wide thread pool (std::thread), grown on demand.
#include "thread_pool.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvb {
namespace {

constexpr int kSpinUs = 2000;  // how long an idle worker watches for work

// Completion counter of one parallel_for call.
struct Latch {
  std::mutex mu;
  std::condition_variable cv;
  int pending = 0;

  void done() {
    std::lock_guard<std::mutex> lock(mu);
    if (--pending == 0) cv.notify_all();
  }
};

struct Task {
  const std::function<void(int)>* fn;
  int index;
  Latch* latch;
};

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      stop_flag_.store(true);
    }
    cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  void run(int n, const std::function<void(int)>& fn) {
    Latch latch;
    latch.pending = n - 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (static_cast<int>(workers_.size()) < n - 1) {
        workers_.emplace_back([this] { work(); });
      }
      for (int i = 1; i < n; ++i) queue_.push_back(Task{&fn, i, &latch});
      queued_.store(queue_.size(), std::memory_order_relaxed);
    }
    cv_.notify_all();
    fn(0);
    // Help with queued work (ours or another caller's) instead of idling.
    for (;;) {
      Task t{};
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (queue_.empty()) break;
        t = queue_.front();
        queue_.pop_front();
        queued_.store(queue_.size(), std::memory_order_relaxed);
      }
      (*t.fn)(t.index);
      t.latch->done();
    }
    std::unique_lock<std::mutex> lock(latch.mu);
    latch.cv.wait(lock, [&] { return latch.pending == 0; });
  }

 private:
  void work() {
    for (;;) {
      spin_for_work();
      Task t{};
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left
        t = queue_.front();
        queue_.pop_front();
        queued_.store(queue_.size(), std::memory_order_relaxed);
      }
      (*t.fn)(t.index);
      t.latch->done();
    }
  }

  // Before sleeping, a worker that just ran a task watches the queue for a
  // while (yielding its core between looks): a copy split across threads
  // comes in bursts, and a sleeping worker is woken late (a halted vCPU, or
  // woken onto the caller's core, where it only time-shares with it).
  void spin_for_work() {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinUs);
    while (queued_.load(std::memory_order_relaxed) == 0 && !stop_flag_.load()) {
      if (std::chrono::steady_clock::now() >= until) return;
      std::this_thread::yield();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
  std::atomic<size_t> queued_{0};       // queue_.size(), for spin_for_work
  std::atomic<bool> stop_flag_{false};  // stop_, for spin_for_work
};

std::mutex g_pool_mu;
std::unique_ptr<Pool> g_pool;  // destroyed (workers joined) at exit
pid_t g_pool_pid = 0;

Pool& pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (g_pool && g_pool_pid != getpid()) {
    // Forked child: the parent's workers do not exist here.  Leak the old
    // object (its mutexes may be in any state) and start afresh.
    (void)g_pool.release();
  }
  if (!g_pool) {
    g_pool = std::make_unique<Pool>();
    g_pool_pid = getpid();
  }
  return *g_pool;
}

}  // namespace

void parallel_for(int n, const std::function<void(int)>& fn) {
  if (n <= 1) {
    fn(0);
    return;
  }
  pool().run(n, fn);
}

}  // namespace kvb
