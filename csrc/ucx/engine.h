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
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
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
  // The connection tag the peer issued to us: the sender field of every
  // message we send it (the DONEs encoded here included).
  std::string tag;
  // The put window: puts posted on this endpoint and not yet complete, and
  // the put batches with runs still to post, served round-robin.
  size_t puts_in_flight = 0;
  std::deque<uint64_t> waiting;
};

// A request the receiver expects (UcxAgent.expect), so that its DONE messages
// land in C++ as they arrive.  `landed` has one flag per layer of [l0, l1).
struct Expectation {
  uint64_t token = 0;
  std::string rid;
  uint64_t start = 0, end = 0, l0 = 0, l1 = 0;
  std::string sender;  // the peer it is bound to (its agent id), or empty: any
  uint64_t pages = 0;  // the pages digest a DONE must name (messages.h)
  std::vector<uint8_t> landed;
  uint64_t missing = 0;  // layers not landed yet
};

// A DONE applied to an expectation in C++, for Python to account: `layers`
// had landed after it, all of them when `complete`.
struct Landed {
  uint64_t token;
  uint64_t l0, l1, nbytes;
  std::string sender;
  uint64_t layers;
  bool complete;
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

// One posted unit of work: a batch of puts + flush (+ notification), or one
// active message.  Done when `pending` reaches zero, every run was posted and
// flushed, and the notification, if any, has been sent.
struct Op {
  uint64_t id = 0;
  uint64_t ep_id = 0;
  int pending = 0;  // requests of this op in flight (puts, flush, message)
  ucs_status_t status = UCS_OK;
  std::string notify;  // sent as an active message after the flush completed
  bool notify_posted = false;
  bool report = true;   // queue the result for drain(); false: fire and forget
  bool waited = false;  // a caller spins on it: its result goes to sync_done_
  // a put batch: runs[next..] are not posted yet (the endpoint's window)
  std::vector<PutRun> runs;
  size_t next = 0;
  bool flush_posted = true;  // false for a put batch until its flush is posted
};

struct OpResult {
  uint64_t op_id;
  int status;  // ucs_status_t
};

struct EpFailure {
  uint64_t ep_id;
  int status;
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
  std::vector<Landed> landed;
};

// What a request's ticket stands for (see on_request_done).
enum class ReqKind : uint8_t { kPut, kFlush, kMessage };

class Engine {
 public:
  static constexpr uint16_t kAmId = 0x4b56;  // "KV"
  static constexpr size_t kMaxMessage = 64 * 1024;

  explicit Engine(const std::vector<std::pair<std::string, std::string>>& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  std::string address() const { return address_; }
  // The agent id that DONE messages built here name as their sender.
  void set_agent_id(const std::string& id);
  const std::string& agent_id() const { return agent_id_; }
  // At most `n` puts in flight per endpoint (0: no limit); runs beyond it are
  // posted as earlier puts complete, round-robin between the endpoint's batches.
  void set_put_window(size_t n);
  // Busy-polls (an inline put, poll()) give the core away after `us` without
  // an event (0: after every empty progress call).
  void set_yield_us(unsigned us);

  // ---- progress driven by the caller (asyncio's "loop" mode) ----
  int event_fd() const { return efd_; }
  // Progress until idle (bounded), posting deferred notifications.  Returns
  // the number of events handled.
  unsigned progress();
  // Arm the event fd; false when events are pending (progress again first).
  bool arm();
  // Progress for up to `max_us`, returning as soon as something is queued
  // for drain() or expectation `token` (0: none) is complete.  Gives the core
  // away (sched_yield) after every `yield_us` without an event.  The GIL must
  // not be held.  Returns true when something is queued for drain().
  bool poll(unsigned max_us, uint64_t token, unsigned yield_us);
  // Takes out of the queue for drain() the DONEs of expectation `token` when
  // they completed it, returning their bytes; else -1, or -2 when something
  // else is queued for drain().  (A receive that polls for its own request
  // resolves from this without draining and accounting everything.)
  int64_t take_landed(uint64_t token);

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
  // `force`: close without flushing what we posted to it (a peer that
  // stopped answering: a flush would wait for it in vain).
  void disconnect(uint64_t ep_id, bool force = false);
  bool endpoint_ok(uint64_t ep_id) const;

  // Post a put batch, its flush and (after the flush) the notification; then
  // progress for up to `spin_us` waiting for the whole op.  The GIL must not
  // be held.
  Posted put(uint64_t ep_id, const PutRun* runs, size_t count, const std::string& notify,
             unsigned spin_us);
  // One active message.  `report`: queue its result for drain().
  Posted send(uint64_t ep_id, const std::string& message, bool report);
  // Flush the endpoint (remote completion of every put posted on it before
  // this call), then send `message`: what an ABORT and an ABORT_ACK take, so
  // that they arrive after every byte posted before them landed.  Not held
  // back by the put window.  The result is queued for drain().
  Posted flush_send(uint64_t ep_id, const std::string& message);
  // Stop the put batches `op_ids` on `ep_id`: their runs not posted yet are
  // never posted, their notifications never sent; each finishes with
  // UCS_ERR_CANCELED once its puts in flight completed.  Ops that finished
  // (or are not put batches of this endpoint) are left alone.  Returns how
  // many were stopped.
  size_t cancel_ops(uint64_t ep_id, const std::vector<uint64_t>& op_ids);

  // ---- the receiving side's expectations ----
  // DONE messages under a connection tag in add_peer() (who sent it is the
  // agent id that tag was issued to, never the message's word), for a
  // registered request with the same tokens, layers inside its range and
  // the expectation's pages digest, land here (queued as Landed for
  // drain()); every other message goes to Python as it is.  `sender` (an
  // agent id) empty: bound by the first part.
  void add_peer(const std::string& tag, const std::string& agent_id);
  void remove_peer(const std::string& tag);
  // The tag to write as the sender of what goes out on `ep_id`.
  void set_ep_tag(uint64_t ep_id, const std::string& tag);
  std::string ep_tag(uint64_t ep_id) const;
  void expect(uint64_t token, const std::string& rid, uint64_t start, uint64_t end, uint64_t l0,
              uint64_t l1, const std::string& sender, uint64_t pages);
  void unexpect(uint64_t token);
  // A part Python applied itself (a part that came before the expect, a
  // staged part): mark layers [l0, l1) and bind the sender.  Returns the
  // layers landed so far, or -1 for an unknown token.
  int64_t mark(uint64_t token, uint64_t l0, uint64_t l1, const std::string& sender);
  // Layers landed so far and whether all have; (-1, false) for an unknown token.
  std::pair<int64_t, bool> expect_state(uint64_t token) const;

  Drained drain();

  void close();
  bool closed() const;

  // callbacks (public for the C trampolines); the mutex is held
  void on_ep_error(Endpoint* ep, ucs_status_t status);
  void on_request_done(uint64_t op_id, ReqKind kind, ucs_status_t status);
  void on_message(const void* data, size_t length);

 private:
  using Clock = std::chrono::steady_clock;
  Endpoint& endpoint(uint64_t ep_id);
  // Up to `max_rounds` worker progress calls, until one finds nothing; or
  // until op `wait_op` completed (waited: its result is in sync_done_) or
  // expectation `wait_token` is complete, when one is given: a caller that
  // waits for one thing returns as soon as it happened.
  unsigned progress_locked(int max_rounds, uint64_t wait_op = 0, uint64_t wait_token = 0);
  void finish_if_done(Op& op);
  void post_notify(Op& op);
  void post_flush(Op& op, Endpoint& ep);
  void post_puts(Endpoint& ep);
  void check_open() const;
  void disconnect_locked(uint64_t ep_id, bool force = false);
  void signal_python();
  bool python_work() const;
  // Expectation `token` is complete or unknown (a complete one is forgotten).
  bool expect_done(uint64_t token) const;
  void wake_thread();
  void leave_polling();  // with mu_ held: a poller outside the thread is done
  void thread_main(unsigned spin_us);
  bool take_sync(uint64_t op_id, int* status);
  bool apply_done(const void* data, size_t length);

  mutable std::mutex mu_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::string address_;
  std::string agent_id_;
  size_t put_window_ = 0;
  unsigned yield_us_ = 0;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Region> regions_;
  std::map<uint64_t, std::unique_ptr<Endpoint>> eps_;
  // Closed endpoints stay allocated until the worker is destroyed: UCP may
  // still report an error on them, and the callback argument must stay valid.
  std::vector<std::unique_ptr<Endpoint>> closed_eps_;
  std::unordered_map<uint64_t, Op> ops_;
  std::vector<uint64_t> deferred_notify_;
  std::vector<uint64_t> deferred_puts_;  // endpoints whose window opened
  std::vector<OpResult> results_;
  std::vector<EpFailure> failures_;
  std::vector<std::string> messages_;
  std::vector<Landed> landed_;
  std::unordered_map<uint64_t, int> sync_done_;
  std::unordered_map<uint64_t, Expectation> expects_;
  std::unordered_map<std::string, uint64_t> expect_ids_;  // request id -> token
  std::unordered_map<std::string, std::string> peers_;  // connection tag -> agent id

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
  std::atomic<int64_t> activity_ns_{0};     // last post or poll (steady clock)
  std::atomic<int64_t> polled_ns_{0};       // last progress by a poller outside the thread
  std::atomic<bool> sleeping_{false};       // the thread is in epoll_wait
  std::atomic<bool> standing_down_{false};  // ... on its wake fd alone, while another polls
};

}  // namespace kvb::ucx
