// Endpoints, one-sided put batches ordered before their notification (posted
// through each endpoint's put window), and small active messages.
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <limits>

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
  ReqKind kind;
};

void request_cb(void* request, ucs_status_t status, void* user_data) {
  auto* t = static_cast<Ticket*>(user_data);
  Engine* engine = t->engine;
  uint64_t op_id = t->op_id;
  ReqKind kind = t->kind;
  delete t;
  ucp_request_free(request);
  engine->on_request_done(op_id, kind, status);
}

// Count a non-blocking call's outcome into the op; returns true when the
// request is in flight (its callback will come).
bool account(Op& op, ucs_status_ptr_t sp, Ticket* ticket) {
  if (sp == nullptr) {  // completed in place
    delete ticket;
    return false;
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

void Engine::disconnect(uint64_t ep_id, bool force) {
  std::lock_guard<std::mutex> lock(mu_);
  disconnect_locked(ep_id, force);
}

void Engine::disconnect_locked(uint64_t ep_id, bool force) {
  auto it = eps_.find(ep_id);
  if (it == eps_.end()) return;
  Endpoint& ep = *it->second;
  ep.closing = true;
  // Batches with runs still to post will never post them.
  std::deque<uint64_t> waiting;
  waiting.swap(ep.waiting);
  for (uint64_t id : waiting) {
    auto op = ops_.find(id);
    if (op == ops_.end()) continue;
    if (op->second.status == UCS_OK) op->second.status = UCS_ERR_CANCELED;
    op->second.runs.clear();
    finish_if_done(op->second);
  }
  for (auto& r : ep.remote) ucp_rkey_destroy(r.rkey);
  ep.remote.clear();
  // A forced close is only defined when both sides use peer error handling
  // (it may break the remote side otherwise), or when the peer is gone.
  ucp_request_param_t cp{};
  cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // `force`: the peer stopped answering (an ABORT it never acknowledged): a
  // flush would wait for it in vain.
  cp.flags = (force || ep.peer_errors || ep.error != UCS_OK) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
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

void Engine::on_request_done(uint64_t op_id, ReqKind kind, ucs_status_t status) {
  if (kind == ReqKind::kPut) {
    auto op = ops_.find(op_id);
    auto ep = eps_.find(op == ops_.end() ? 0 : op->second.ep_id);
    if (ep != eps_.end()) {
      Endpoint& e = *ep->second;
      if (e.puts_in_flight > 0) --e.puts_in_flight;
      // The window opened: post more (not from inside the callback).
      if (!e.waiting.empty()) deferred_puts_.push_back(e.id);
    }
  }
  auto it = ops_.find(op_id);
  if (it == ops_.end()) return;
  Op& op = it->second;
  --op.pending;
  if (status != UCS_OK && op.status == UCS_OK) op.status = status;
  if (op.pending == 0 && op.flush_posted && op.status == UCS_OK && !op.notify.empty() &&
      !op.notify_posted) {
    // Not from inside a callback: progress() posts it right after.
    deferred_notify_.push_back(op_id);
    return;
  }
  finish_if_done(op);
}

void Engine::finish_if_done(Op& op) {
  if (op.pending != 0) return;
  if (op.status == UCS_OK && !op.flush_posted) return;  // runs still to post
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
    auto* ticket = new Ticket{this, op.id, ReqKind::kMessage};
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

void Engine::post_flush(Op& op, Endpoint& ep) {
  // The flush completes only when every put posted before it is complete at
  // the target: the notification is posted after it, never when the puts are
  // merely posted.
  op.flush_posted = true;
  op.runs.clear();
  op.runs.shrink_to_fit();
  if (op.status == UCS_OK) {
    auto* ticket = new Ticket{this, op.id, ReqKind::kFlush};
    ucp_request_param_t fp = request_param(ticket);
    account(op, ucp_ep_flush_nbx(ep.ep, &fp), ticket);
  }
  if (op.pending == 0 && op.status == UCS_OK && !op.notify.empty()) {
    post_notify(op);
  } else {
    finish_if_done(op);
  }
}

void Engine::post_puts(Endpoint& ep) {
  // Without a window every run of a batch is posted at once; with one, one
  // run per batch per turn, so that a small batch is not queued behind all
  // of a large one.
  const size_t window = put_window_ == 0 ? std::numeric_limits<size_t>::max() : put_window_;
  while (!ep.waiting.empty() && ep.puts_in_flight < window) {
    const uint64_t id = ep.waiting.front();
    ep.waiting.pop_front();
    auto it = ops_.find(id);
    if (it == ops_.end()) continue;
    Op& op = it->second;
    if (ep.error != UCS_OK && op.status == UCS_OK) op.status = ep.error;
    while (op.next < op.runs.size() && op.status == UCS_OK && ep.puts_in_flight < window) {
      const PutRun& r = op.runs[op.next++];
      if (r.length == 0) continue;
      auto reg = regions_.find(r.local_region);
      if (reg == regions_.end() || r.remote_region >= ep.remote.size()) {
        op.status = UCS_ERR_INVALID_PARAM;
        break;
      }
      auto* ticket = new Ticket{this, id, ReqKind::kPut};
      ucp_request_param_t p = request_param(ticket);
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = reg->second.memh;
      const RemoteRegion& rr = ep.remote[r.remote_region];
      if (account(op,
                  ucp_put_nbx(ep.ep, reinterpret_cast<void*>(reg->second.base + r.local_off),
                              r.length, rr.base + r.remote_off, rr.rkey, &p),
                  ticket))
        ++ep.puts_in_flight;
      if (put_window_ != 0) break;
    }
    if (op.next < op.runs.size() && op.status == UCS_OK) {
      ep.waiting.push_back(id);  // its turn comes again
    } else {
      post_flush(op, ep);  // or finish with the error
    }
  }
}

Posted Engine::put(uint64_t ep_id, const PutRun* runs, size_t count, const std::string& notify,
                   unsigned spin_us) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  Endpoint& ep = endpoint(ep_id);
  if (ep.error != UCS_OK) throw UcsError(ep.error, "endpoint failed");
  if (notify.size() > kMaxMessage) throw UcsError(UCS_ERR_INVALID_PARAM, "notification too large");
  // Validate everything before posting anything.
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
  }
  uint64_t id = next_id_++;
  Op& op = ops_[id];
  op.id = id;
  op.ep_id = ep_id;
  op.notify = notify;
  op.waited = true;
  op.runs.assign(runs, runs + count);
  op.flush_posted = false;
  ep.waiting.push_back(id);
  post_puts(ep);  // `op` may be gone after this (finished in place)
  // The fast path: a small batch usually completes (flush answered, the
  // notification sent) within a few round trips; progress here for that long
  // instead of handing back to the event loop and waking up again.
  int status = UCS_INPROGRESS;
  if (take_sync(id, &status)) return {id, status};
  if (spin_us > 0) {
    pollers_.fetch_add(1);
    const auto start = Clock::now();
    const auto until = start + std::chrono::microseconds(spin_us);
    auto last_event = start;
    bool done = false;
    do {
      const auto now = Clock::now();
      if (progress_locked(16, id) > 0) {
        last_event = now;
      } else if (now - last_event >= std::chrono::microseconds(yield_us_)) {
        sched_yield();  // the peer may need this core to answer
      }
      polled_ns_.store(now.time_since_epoch().count());
      done = take_sync(id, &status);
    } while (!done && Clock::now() < until);
    leave_polling();
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

Posted Engine::flush_send(uint64_t ep_id, const std::string& message) {
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
  op.flush_posted = false;
  // No runs: the flush is posted at once, ahead of batches still waiting
  // for the window (those post their runs after it and are not covered;
  // cancel_ops stops the ones that must not).
  post_flush(op, ep);  // `op` may be gone after this
  int status = UCS_INPROGRESS;
  if (take_sync(id, &status)) return {id, status};
  auto it = ops_.find(id);
  if (it != ops_.end()) it->second.waited = false;
  wake_thread();
  return {id, UCS_INPROGRESS};
}

size_t Engine::cancel_ops(uint64_t ep_id, const std::vector<uint64_t>& op_ids) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t stopped = 0;
  auto e = eps_.find(ep_id);
  for (uint64_t id : op_ids) {
    auto it = ops_.find(id);
    if (it == ops_.end() || it->second.ep_id != ep_id) continue;
    Op& op = it->second;
    if (op.notify_posted) continue;  // its DONE left: every run was posted and flushed
    if (e != eps_.end()) {
      auto& w = e->second->waiting;
      w.erase(std::remove(w.begin(), w.end(), id), w.end());
    }
    if (op.status == UCS_OK) op.status = UCS_ERR_CANCELED;
    op.runs.clear();
    op.runs.shrink_to_fit();
    op.flush_posted = true;  // nothing more to post; its puts in flight still count
    ++stopped;
    finish_if_done(op);  // `op` may be gone after this
  }
  return stopped;
}

}  // namespace kvb::ucx
