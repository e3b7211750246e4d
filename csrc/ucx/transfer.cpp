// Endpoints, one-sided put batches ordered before their notification, and
// small active messages.
#include <sched.h>

#include <chrono>

#include "engine.h"

namespace kvb::ucx {

namespace {

void ep_error_cb(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* ep = static_cast<Endpoint*>(arg);
  ep->engine->on_ep_error(ep, status);
}

struct Ticket {
  Engine* engine;
  uint64_t op_id;
};

void request_cb(void* request, ucs_status_t status, void* user_data) {
  auto* t = static_cast<Ticket*>(user_data);
  Engine* engine = t->engine;
  uint64_t op_id = t->op_id;
  delete t;
  ucp_request_free(request);
  engine->on_request_done(op_id, status);
}

// Count a non-blocking call's outcome into the op; returns false on failure.
bool account(Op& op, ucs_status_ptr_t sp, Ticket* ticket) {
  if (sp == nullptr) {  // completed in place
    delete ticket;
    return true;
  }
  if (UCS_PTR_IS_ERR(sp)) {
    delete ticket;
    if (op.status == UCS_OK) op.status = UCS_PTR_STATUS(sp);
    return false;
  }
  ++op.pending;
  return true;
}

ucp_request_param_t request_param(Ticket* ticket) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = request_cb;
  p.user_data = ticket;
  return p;
}

}  // namespace

Endpoint& Engine::endpoint(uint64_t ep_id) {
  auto it = eps_.find(ep_id);
  if (it == eps_.end() || it->second->closing)
    throw UcsError(UCS_ERR_INVALID_PARAM, "unknown or closed endpoint");
  return *it->second;
}

bool Engine::endpoint_ok(uint64_t ep_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = eps_.find(ep_id);
  return it != eps_.end() && !it->second->closing && it->second->error == UCS_OK;
}

uint64_t Engine::connect(const std::string& worker_address,
                         const std::vector<std::tuple<uintptr_t, size_t, std::string>>& regions,
                         bool peer_errors) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  auto ep = std::make_unique<Endpoint>();
  ep->engine = this;
  ep->id = next_id_++;
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
  p.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  p.err_handler.cb = ep_error_cb;
  p.err_handler.arg = ep.get();
  ep->peer_errors = peer_errors;
  ucs_status_t st = ucp_ep_create(worker_, &p, &ep->ep);
  if (st != UCS_OK) throw UcsError(st, "ucp_ep_create");
  for (const auto& [base, length, packed] : regions) {
    RemoteRegion rr;
    rr.base = base;
    rr.length = length;
    st = ucp_ep_rkey_unpack(ep->ep, packed.data(), &rr.rkey);
    if (st != UCS_OK) {
      for (auto& r : ep->remote) ucp_rkey_destroy(r.rkey);
      ucp_request_param_t cp{};
      cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      cp.flags = peer_errors ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      ucs_status_ptr_t sp = ucp_ep_close_nbx(ep->ep, &cp);
      while (sp != nullptr && !UCS_PTR_IS_ERR(sp) && ucp_request_check_status(sp) == UCS_INPROGRESS)
        ucp_worker_progress(worker_);
      if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) ucp_request_free(sp);
      throw UcsError(st, "ucp_ep_rkey_unpack");
    }
    ep->remote.push_back(rr);
  }
  uint64_t id = ep->id;
  eps_.emplace(id, std::move(ep));
  wake_thread();  // wire-up needs progress
  return id;
}

void Engine::disconnect(uint64_t ep_id) {
  std::lock_guard<std::mutex> lock(mu_);
  disconnect_locked(ep_id);
}

void Engine::disconnect_locked(uint64_t ep_id) {
  auto it = eps_.find(ep_id);
  if (it == eps_.end()) return;
  Endpoint& ep = *it->second;
  ep.closing = true;
  for (auto& r : ep.remote) ucp_rkey_destroy(r.rkey);
  ep.remote.clear();
  // A forced close is only defined when both sides use peer error handling
  // (it may break the remote side otherwise), or when the peer is gone.
  ucp_request_param_t cp{};
  cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  cp.flags = (ep.peer_errors || ep.error != UCS_OK) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t sp = ucp_ep_close_nbx(ep.ep, &cp);
  if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) {
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (ucp_request_check_status(sp) == UCS_INPROGRESS &&
           std::chrono::steady_clock::now() < until)
      ucp_worker_progress(worker_);
    ucp_request_free(sp);
  }
  closed_eps_.push_back(std::move(it->second));
  eps_.erase(it);
}

void Engine::on_ep_error(Endpoint* ep, ucs_status_t status) {
  if (ep->error != UCS_OK || ep->closing) return;
  ep->error = status;
  failures_.push_back({ep->id, static_cast<int>(status)});
  signal_python();
}

void Engine::on_request_done(uint64_t op_id, ucs_status_t status) {
  auto it = ops_.find(op_id);
  if (it == ops_.end()) return;
  Op& op = it->second;
  --op.pending;
  if (status != UCS_OK && op.status == UCS_OK) op.status = status;
  if (op.pending == 0 && op.status == UCS_OK && !op.notify.empty() && !op.notify_posted) {
    // Not from inside a callback: progress() posts it right after.
    deferred_notify_.push_back(op_id);
    return;
  }
  finish_if_done(op);
}

void Engine::finish_if_done(Op& op) {
  if (op.pending != 0) return;
  if (op.status == UCS_OK && !op.notify.empty() && !op.notify_posted) return;
  if (op.waited) {
    sync_done_[op.id] = static_cast<int>(op.status);
  } else if (op.report) {
    results_.push_back({op.id, static_cast<int>(op.status)});
    signal_python();
  }
  ops_.erase(op.id);
}

bool Engine::take_sync(uint64_t op_id, int* status) {
  auto it = sync_done_.find(op_id);
  if (it == sync_done_.end()) return false;
  *status = it->second;
  sync_done_.erase(it);
  return true;
}

void Engine::post_notify(Op& op) {
  op.notify_posted = true;
  auto it = eps_.find(op.ep_id);
  if (it == eps_.end() || it->second->closing) {
    op.status = UCS_ERR_CANCELED;
  } else if (it->second->error != UCS_OK) {
    op.status = it->second->error;
  } else {
    auto* ticket = new Ticket{this, op.id};
    ucp_request_param_t p = request_param(ticket);
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_EAGER;
    account(
        op,
        ucp_am_send_nbx(it->second->ep, kAmId, nullptr, 0, op.notify.data(), op.notify.size(), &p),
        ticket);
  }
  finish_if_done(op);
}

Posted Engine::put(uint64_t ep_id, const PutRun* runs, size_t count, const std::string& notify,
                   unsigned spin_us) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  Endpoint& ep = endpoint(ep_id);
  if (ep.error != UCS_OK) throw UcsError(ep.error, "endpoint failed");
  if (notify.size() > kMaxMessage) throw UcsError(UCS_ERR_INVALID_PARAM, "notification too large");
  // Validate everything before posting anything.
  std::vector<const Region*> local(count);
  for (size_t i = 0; i < count; ++i) {
    const PutRun& r = runs[i];
    auto it = regions_.find(r.local_region);
    if (it == regions_.end()) throw UcsError(UCS_ERR_INVALID_PARAM, "unknown local region");
    if (r.local_off > it->second.length || r.length > it->second.length - r.local_off)
      throw UcsError(UCS_ERR_INVALID_PARAM, "run outside the local region");
    if (r.remote_region >= ep.remote.size())
      throw UcsError(UCS_ERR_INVALID_PARAM, "unknown remote region");
    const RemoteRegion& rr = ep.remote[r.remote_region];
    if (r.remote_off > rr.length || r.length > rr.length - r.remote_off)
      throw UcsError(UCS_ERR_INVALID_PARAM, "run outside the remote region");
    local[i] = &it->second;
  }
  uint64_t id = next_id_++;
  Op& op = ops_[id];
  op.id = id;
  op.ep_id = ep_id;
  op.notify = notify;
  op.waited = true;
  for (size_t i = 0; i < count && op.status == UCS_OK; ++i) {
    const PutRun& r = runs[i];
    if (r.length == 0) continue;
    auto* ticket = new Ticket{this, id};
    ucp_request_param_t p = request_param(ticket);
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = local[i]->memh;
    const RemoteRegion& rr = ep.remote[r.remote_region];
    account(op,
            ucp_put_nbx(ep.ep, reinterpret_cast<void*>(local[i]->base + r.local_off), r.length,
                        rr.base + r.remote_off, rr.rkey, &p),
            ticket);
  }
  // The flush completes only when every put above is complete at the target:
  // the notification is posted after it, never when the puts are merely posted.
  auto* ticket = new Ticket{this, id};
  ucp_request_param_t fp = request_param(ticket);
  account(op, ucp_ep_flush_nbx(ep.ep, &fp), ticket);
  if (op.pending == 0 && op.status == UCS_OK && !op.notify.empty()) {
    post_notify(op);
  } else {
    finish_if_done(op);
  }
  // The fast path: a small batch usually completes (flush answered, the
  // notification sent) within a few round trips; progress here for that long
  // instead of handing back to the event loop and waking up again.
  int status = UCS_INPROGRESS;
  if (take_sync(id, &status)) return {id, status};
  if (spin_us > 0) {
    pollers_.fetch_add(1);
    const auto until = Clock::now() + std::chrono::microseconds(spin_us);
    bool done = false;
    do {
      if (progress_locked(16) == 0) sched_yield();  // the peer may need this core to answer
      polled_ns_.store(Clock::now().time_since_epoch().count());
      done = take_sync(id, &status);
    } while (!done && Clock::now() < until);
    pollers_.fetch_sub(1);
    activity_ns_.store(Clock::now().time_since_epoch().count());
    if (done) return {id, status};
  }
  // Still in flight: its result comes through drain().
  auto it = ops_.find(id);
  if (it != ops_.end()) it->second.waited = false;
  if (take_sync(id, &status)) return {id, status};
  wake_thread();
  return {id, UCS_INPROGRESS};
}

Posted Engine::send(uint64_t ep_id, const std::string& message, bool report) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  Endpoint& ep = endpoint(ep_id);
  if (ep.error != UCS_OK) throw UcsError(ep.error, "endpoint failed");
  if (message.empty() || message.size() > kMaxMessage)
    throw UcsError(UCS_ERR_INVALID_PARAM, "message size out of range");
  uint64_t id = next_id_++;
  Op& op = ops_[id];
  op.id = id;
  op.ep_id = ep_id;
  op.notify = message;
  op.waited = true;
  post_notify(op);
  int status = UCS_INPROGRESS;
  if (take_sync(id, &status)) return {id, status};  // sent in place (eager)
  auto it = ops_.find(id);
  if (it != ops_.end()) {
    it->second.waited = false;
    it->second.report = report;
  }
  wake_thread();
  return {id, UCS_INPROGRESS};
}

}  // namespace kvb::ucx
