// kvbridge UCX engine: one UCP context + worker, big registered regions,
// endpoints with optional peer error handling, batched one-sided puts that
// complete only after a flush, and small active messages for control and
// notifications.
//
// Threads: every public method takes the engine's mutex, so the Python thread
// that owns the asyncio loop, a staging worker thread and the engine's own
// progress thread may call in (the worker runs UCS_THREAD_MODE_SERIALIZED).
// UCP callbacks run inside ucp_worker_progress, with the mutex held, and only
// touch C++ state.  Results, endpoint failures and received messages queue up
// until Python drains them; in thread mode the engine writes its notify fd
// (an eventfd) when the queues go from empty to non-empty.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvb::ucx {

// A UCS failure, carrying its status so that Python can map it.
class UcsError : public std::runtime_error {
 public:
  UcsError(ucs_status_t status, const std::string& what)
      : std::runtime_error(what + ": " + ucs_status_string(status)), status_(status) {}
  ucs_status_t status() const { return status_; }

 private:
  ucs_status_t status_;
};

struct Region {
  uintptr_t base = 0;
  size_t length = 0;
  ucp_mem_h memh = nullptr;
  std::string rkey;  // packed remote key
};

struct RemoteRegion {
  uintptr_t base = 0;
  size_t length = 0;
  ucp_rkey_h rkey = nullptr;
};

class Engine;

struct Endpoint {
  Engine* engine = nullptr;
  uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  std::vector<RemoteRegion> remote;
  ucs_status_t error = UCS_OK;  // set by the error callback
  bool peer_errors = true;      // UCP_ERR_HANDLING_MODE_PEER
  bool closing = false;
};

// One posted unit of work: a batch of puts + flush (+ notification), or one
// active message.  Done when `pending` reaches zero and the notification, if
// any, has been sent.
struct Op {
  uint64_t id = 0;
  uint64_t ep_id = 0;
  int pending = 0;
  ucs_status_t status = UCS_OK;
  std::string notify;  // sent as an active message after the flush completed
  bool notify_posted = false;
  bool report = true;   // queue the result for drain(); false: fire and forget
  bool waited = false;  // a caller spins on it: its result goes to sync_done_
};

struct OpResult {
  uint64_t op_id;
  int status;  // ucs_status_t
};

struct EpFailure {
  uint64_t ep_id;
  int status;
};

// One run of a put batch: bytes [local_off, local_off+len) of local region
// `local_region` go to [remote_off, remote_off+len) of remote region `remote_region`.
struct PutRun {
  uint64_t local_region;
  uint64_t local_off;
  uint64_t remote_region;
  uint64_t remote_off;
  uint64_t length;
};

// What a post returns: the op id and UCS_INPROGRESS, or the final status when
// the op completed before the call returned (then no result is queued).
struct Posted {
  uint64_t op_id;
  int status;
};

struct Drained {
  std::vector<OpResult> results;
  std::vector<EpFailure> failures;
  std::vector<std::string> messages;
};

class Engine {
 public:
  static constexpr uint16_t kAmId = 0x4b56;  // "KV"
  static constexpr size_t kMaxMessage = 64 * 1024;

  explicit Engine(const std::vector<std::pair<std::string, std::string>>& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  std::string address() const { return address_; }

  // ---- progress driven by the caller (asyncio's "loop" mode) ----
  int event_fd() const { return efd_; }
  // Progress until idle (bounded), posting deferred notifications.  Returns
  // the number of events handled.
  unsigned progress();
  // Arm the event fd; false when events are pending (progress again first).
  bool arm();

  // ---- progress on the engine's own thread ("thread" mode) ----
  // The thread progresses while there is activity and for `spin_us` after
  // the last event, then arms the worker and sleeps in epoll on the worker's
  // event fd.  Python watches notify_fd() (readable when there is something
  // to drain).
  void start_thread(unsigned spin_us);
  void stop_thread();
  // The caller polls (progress()) for a while: the thread neither spins nor
  // signals meanwhile; clearing it signals if anything is queued.
  void set_polling(bool on);
  int notify_fd() const { return notify_fd_; }
  bool threaded() const;

  uint64_t register_region(uintptr_t base, size_t length);
  std::string rkey(uint64_t id) const;
  void deregister_region(uint64_t id);

  uint64_t connect(const std::string& worker_address,
                   const std::vector<std::tuple<uintptr_t, size_t, std::string>>& regions,
                   bool peer_errors);
  void disconnect(uint64_t ep_id);
  bool endpoint_ok(uint64_t ep_id) const;

  // Post a put batch, its flush and (after the flush) the notification; then
  // progress for up to `spin_us` waiting for the whole op.  The GIL must not
  // be held.
  Posted put(uint64_t ep_id, const PutRun* runs, size_t count, const std::string& notify,
             unsigned spin_us);
  // One active message.  `report`: queue its result for drain().
  Posted send(uint64_t ep_id, const std::string& message, bool report);

  Drained drain();

  void close();
  bool closed() const;

  // callbacks (public for the C trampolines); the mutex is held
  void on_ep_error(Endpoint* ep, ucs_status_t status);
  void on_request_done(uint64_t op_id, ucs_status_t status);
  void on_message(const void* data, size_t length);

 private:
  using Clock = std::chrono::steady_clock;
  Endpoint& endpoint(uint64_t ep_id);
  unsigned progress_locked(int max_rounds);
  void finish_if_done(Op& op);
  void post_notify(Op& op);
  void check_open() const;
  void disconnect_locked(uint64_t ep_id);
  void signal_python();
  void wake_thread();
  void thread_main(unsigned spin_us);
  bool take_sync(uint64_t op_id, int* status);

  mutable std::mutex mu_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::string address_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Region> regions_;
  std::map<uint64_t, std::unique_ptr<Endpoint>> eps_;
  // Closed endpoints stay allocated until the worker is destroyed: UCP may
  // still report an error on them, and the callback argument must stay valid.
  std::vector<std::unique_ptr<Endpoint>> closed_eps_;
  std::unordered_map<uint64_t, Op> ops_;
  std::vector<uint64_t> deferred_notify_;
  std::vector<OpResult> results_;
  std::vector<EpFailure> failures_;
  std::vector<std::string> messages_;
  std::unordered_map<uint64_t, int> sync_done_;

  // thread mode
  std::thread thread_;
  std::atomic<bool> stop_{false};
  int wake_fd_ = -1;    // eventfd: Python -> progress thread
  int notify_fd_ = -1;  // eventfd: engine -> Python
  bool notified_ = false;
  bool thread_on_ = false;   // guarded by mu_
  bool py_polling_ = false;  // guarded by mu_
  // Busy-pollers outside the thread (an inline put spin, the loop's poll):
  // while there is one, the thread sleeps instead of spinning.
  std::atomic<int> pollers_{0};
  std::atomic<int64_t> activity_ns_{0};  // last post or poll (steady clock)
  std::atomic<int64_t> polled_ns_{0};    // last progress by a poller outside the thread
  std::atomic<bool> sleeping_{false};    // the thread is in epoll_wait
};

}  // namespace kvb::ucx
