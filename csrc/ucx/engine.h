// kvbridge UCX engine: one UCP context + worker, big registered regions,
// endpoints with peer error handling, batched one-sided puts that complete
// only after a flush, and small active messages for control and notifications.
//
// Single-threaded by design: every method runs on the thread that owns the
// asyncio loop.  Callbacks from UCP run inside progress() and only touch C++
// state; Python drains the results with drain().
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
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

class Engine {
 public:
  static constexpr uint16_t kAmId = 0x4b56;  // "KV"
  static constexpr size_t kMaxMessage = 64 * 1024;

  explicit Engine(const std::vector<std::pair<std::string, std::string>>& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  std::string address() const { return address_; }
  int event_fd() const { return efd_; }
  // Progress until idle (bounded); then post deferred notifications.  Returns
  // the number of events handled.
  unsigned progress();
  // Arm the event fd; false when events are pending (progress again first).
  bool arm();

  uint64_t register_region(uintptr_t base, size_t length);
  const Region& region(uint64_t id) const;
  void deregister_region(uint64_t id);

  uint64_t connect(const std::string& worker_address,
                   const std::vector<std::tuple<uintptr_t, size_t, std::string>>& regions,
                   bool peer_errors);
  void disconnect(uint64_t ep_id);
  bool endpoint_ok(uint64_t ep_id) const;

  uint64_t put(uint64_t ep_id, const PutRun* runs, size_t count, const std::string& notify);
  uint64_t send(uint64_t ep_id, const std::string& message);

  std::vector<OpResult> take_results();
  std::vector<EpFailure> take_failures();
  std::vector<std::string> take_messages();

  void close();
  bool closed() const { return worker_ == nullptr; }

  // callbacks (public for the C trampolines)
  void on_ep_error(Endpoint* ep, ucs_status_t status);
  void on_request_done(uint64_t op_id, ucs_status_t status);
  void on_message(const void* data, size_t length);

 private:
  Endpoint& endpoint(uint64_t ep_id);
  void finish_if_done(Op& op);
  void post_notify(Op& op);
  void check_open() const;

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
  std::map<uint64_t, Op> ops_;
  std::vector<uint64_t> deferred_notify_;
  std::vector<OpResult> results_;
  std::vector<EpFailure> failures_;
  std::vector<std::string> messages_;
};

}  // namespace kvb::ucx
