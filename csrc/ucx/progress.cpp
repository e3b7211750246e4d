// Worker progress: driven by the caller (loop mode), or by the engine's own
// thread, which spins for a bounded time after activity and otherwise sleeps
// in epoll on the worker's event fd (thread mode).
#include <sched.h>
#include <sys/epoll.h>
#include <unistd.h>

#include "engine.h"

namespace kvb::ucx {

unsigned Engine::progress_locked(int max_rounds, uint64_t wait_op, uint64_t wait_token) {
  if (worker_ == nullptr) return 0;
  unsigned total = 0;
  for (int i = 0; i < max_rounds; ++i) {
    if (i > 0 && ((wait_op != 0 && sync_done_.count(wait_op) != 0) ||
                  (wait_token != 0 && expect_done(wait_token))))
      break;
    unsigned n = ucp_worker_progress(worker_);
    total += n;
    if (!deferred_puts_.empty()) {
      std::vector<uint64_t> ids;
      ids.swap(deferred_puts_);
      for (size_t j = 0; j < ids.size(); ++j) {
        if (j > 0 && ids[j] == ids[j - 1]) continue;
        auto it = eps_.find(ids[j]);
        if (it != eps_.end() && !it->second->closing) post_puts(*it->second);
      }
    }
    if (!deferred_notify_.empty()) {
      std::vector<uint64_t> ids;
      ids.swap(deferred_notify_);
      for (uint64_t id : ids) {
        auto it = ops_.find(id);
        if (it != ops_.end()) post_notify(it->second);
      }
      continue;
    }
    if (n == 0) break;
  }
  return total;
}

unsigned Engine::progress() {
  std::lock_guard<std::mutex> lock(mu_);
  polled_ns_.store(Clock::now().time_since_epoch().count());
  return progress_locked(4096);
}

void Engine::set_yield_us(unsigned us) {
  std::lock_guard<std::mutex> lock(mu_);
  yield_us_ = us;
}

bool Engine::poll(unsigned max_us, uint64_t token, unsigned yield_us) {
  pollers_.fetch_add(1);
  const auto start = Clock::now();
  const auto until = start + std::chrono::microseconds(max_us);
  const auto quiet = std::chrono::microseconds(yield_us);
  auto last_event = start;
  bool queued = false;
  for (;;) {
    const auto now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (worker_ == nullptr) break;
      polled_ns_.store(now.time_since_epoch().count());
      if (progress_locked(16, 0, token) > 0) last_event = now;
      queued = python_work();
      if (queued) break;
      if (token != 0 && expect_done(token)) break;
    }
    if (Clock::now() >= until) break;
    if (now - last_event >= quiet) sched_yield();  // the peer may need this core
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    leave_polling();
  }
  return queued;
}

void Engine::leave_polling() {
  activity_ns_.store(Clock::now().time_since_epoch().count());
  // The last poller outside the thread is done.  A thread that stood down
  // for it sleeps on its wake fd alone (up to 1 ms, deaf to the worker's
  // events): wake it now, or what arrives next waits for that timeout.
  if (pollers_.fetch_sub(1) == 1 && thread_on_ && standing_down_.load()) {
    uint64_t one = 1;
    ssize_t rc = ::write(wake_fd_, &one, sizeof(one));
    (void)rc;
  }
}

bool Engine::arm() {
  std::lock_guard<std::mutex> lock(mu_);
  if (worker_ == nullptr) return true;
  ucs_status_t st = ucp_worker_arm(worker_);
  if (st == UCS_ERR_BUSY) return false;
  if (st != UCS_OK) throw UcsError(st, "ucp_worker_arm");
  return true;
}

bool Engine::threaded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return thread_on_;
}

void Engine::wake_thread() {
  if (!thread_on_ || !sleeping_.load()) return;
  uint64_t one = 1;
  ssize_t rc = ::write(wake_fd_, &one, sizeof(one));
  (void)rc;
}

void Engine::start_thread(unsigned spin_us) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  if (thread_on_) return;
  stop_.store(false);
  thread_on_ = true;
  thread_ = std::thread([this, spin_us] { thread_main(spin_us); });
}

void Engine::set_polling(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  if (on == py_polling_) return;
  py_polling_ = on;
  if (on) {
    pollers_.fetch_add(1);
  } else {
    leave_polling();
    if (!results_.empty() || !failures_.empty() || !messages_.empty()) signal_python();
    wake_thread();  // the thread takes over (and spins a while: the loop's window ended)
  }
}

void Engine::stop_thread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!thread_on_) return;
    stop_.store(true);
    uint64_t one = 1;
    ssize_t rc = ::write(wake_fd_, &one, sizeof(one));
    (void)rc;
  }
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  thread_on_ = false;
}

void Engine::thread_main(unsigned spin_us) {
  int ep = ::epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) return;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = efd_;
  ::epoll_ctl(ep, EPOLL_CTL_ADD, efd_, &ev);
  ev.data.fd = wake_fd_;
  ::epoll_ctl(ep, EPOLL_CTL_ADD, wake_fd_, &ev);
  // While someone else polls the worker, the thread waits on its wake fd only.
  int ep_wake = ::epoll_create1(EPOLL_CLOEXEC);
  ::epoll_ctl(ep_wake, EPOLL_CTL_ADD, wake_fd_, &ev);
  const auto spin = std::chrono::microseconds(spin_us);
  auto last_event = Clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    int timeout_ms = 100;
    bool sleep = false;
    // Stand down while another poller really polls: one that stopped calling
    // (a loop blocked by the application) does not stall the worker.
    const auto polled = Clock::time_point(Clock::duration(polled_ns_.load()));
    if (pollers_.load() > 0 && Clock::now() - polled < std::chrono::microseconds(200)) {
      sleeping_.store(true);
      standing_down_.store(true);
      epoll_event got;
      // the poller may have left between the check above and the flag
      if (pollers_.load() > 0 && ::epoll_wait(ep_wake, &got, 1, 1) > 0) {
        uint64_t v = 0;
        ssize_t rc = ::read(wake_fd_, &v, sizeof(v));
        (void)rc;
      }
      standing_down_.store(false);
      sleeping_.store(false);
      last_event = Clock::now();
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (worker_ == nullptr) break;
      // A bounded batch per lock hold: callers that post wait at most one batch.
      if (progress_locked(64) > 0) last_event = Clock::now();
      // Busy-poll for `spin` after the last event or post (the next packet of
      // a small exchange is close), unless someone else polls; then arm and
      // sleep.
      const auto now = Clock::now();
      const auto posted = Clock::time_point(Clock::duration(activity_ns_.load()));
      const bool spinning =
          pollers_.load() == 0 && (now - last_event < spin || now - posted < spin);
      if (!spinning && ucp_worker_arm(worker_) == UCS_OK) {
        sleep = true;
        sleeping_.store(true);  // under the lock: a post after this wakes us
        // Outstanding ops are also progressed on a short timer, in case a
        // transport completes them without an event.
        if (!ops_.empty()) timeout_ms = 1;
      }
    }
    if (!sleep) {
      std::this_thread::yield();  // let a caller waiting on the mutex in
      continue;
    }
    epoll_event got[2];
    int n = ::epoll_wait(ep, got, 2, timeout_ms);
    sleeping_.store(false);
    for (int i = 0; i < n; ++i) {
      if (got[i].data.fd == wake_fd_) {
        uint64_t v = 0;
        ssize_t rc = ::read(wake_fd_, &v, sizeof(v));
        (void)rc;
      }
    }
    if (n > 0) last_event = Clock::now();
  }
  ::close(ep_wake);
  ::close(ep);
}

}  // namespace kvb::ucx
