// Context, worker, regions, active-message receipt, the result queues and
// their notify fd.
#include "engine.h"

#include "messages.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>

namespace kvb::ucx {

namespace {

ucs_status_t am_recv_cb(void* arg, const void* /*header*/, size_t /*header_length*/, void* data,
                        size_t length, const ucp_am_recv_param_t* param) {
  auto* engine = static_cast<Engine*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // Senders always force eager for these small messages; a rendezvous
    // message is not ours.  Returning OK drops it.
    return UCS_OK;
  }
  engine->on_message(data, length);
  return UCS_OK;
}

}  // namespace

Engine::Engine(const std::vector<std::pair<std::string, std::string>>& config) {
  ucp_config_t* cfg = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &cfg);
  if (st != UCS_OK) throw UcsError(st, "ucp_config_read");
  for (const auto& [name, value] : config) {
    st = ucp_config_modify(cfg, name.c_str(), value.c_str());
    if (st != UCS_OK) {
      ucp_config_release(cfg);
      throw UcsError(st, "UCX configuration " + name + "=" + value);
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  st = ucp_init(&params, cfg, &context_);
  ucp_config_release(cfg);
  if (st != UCS_OK) throw UcsError(st, "ucp_init");

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // The engine's mutex serialises every call: the loop thread, a staging
  // worker and the progress thread never use the worker at the same time.
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  st = ucp_worker_create(context_, &wp, &worker_);
  if (st != UCS_OK) {
    ucp_cleanup(context_);
    context_ = nullptr;
    throw UcsError(st, "ucp_worker_create");
  }
  auto fail = [this](ucs_status_t s, const char* what) {
    if (notify_fd_ >= 0) ::close(notify_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    notify_fd_ = wake_fd_ = -1;
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    worker_ = nullptr;
    context_ = nullptr;
    throw UcsError(s, what);
  };
  if ((st = ucp_worker_get_efd(worker_, &efd_)) != UCS_OK) fail(st, "ucp_worker_get_efd");

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  if ((st = ucp_worker_get_address(worker_, &addr, &addr_len)) != UCS_OK)
    fail(st, "ucp_worker_get_address");
  address_.assign(reinterpret_cast<const char*>(addr), addr_len);
  ucp_worker_release_address(worker_, addr);

  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = kAmId;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  hp.cb = am_recv_cb;
  hp.arg = this;
  if ((st = ucp_worker_set_am_recv_handler(worker_, &hp)) != UCS_OK)
    fail(st, "ucp_worker_set_am_recv_handler");
  notify_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (notify_fd_ < 0 || wake_fd_ < 0) fail(UCS_ERR_IO_ERROR, "eventfd");
}

Engine::~Engine() {
  try {
    close();
  } catch (...) {
  }
}

void Engine::check_open() const {
  if (worker_ == nullptr) throw UcsError(UCS_ERR_NO_RESOURCE, "the UCX engine is closed");
}

uint64_t Engine::register_region(uintptr_t base, size_t length) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  if (length == 0) throw UcsError(UCS_ERR_INVALID_PARAM, "cannot register an empty region");
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = reinterpret_cast<void*>(base);
  mp.length = length;
  Region r;
  r.base = base;
  r.length = length;
  ucs_status_t st = ucp_mem_map(context_, &mp, &r.memh);
  if (st != UCS_OK) throw UcsError(st, "ucp_mem_map");
  void* rkey = nullptr;
  size_t rkey_len = 0;
  st = ucp_rkey_pack(context_, r.memh, &rkey, &rkey_len);
  if (st != UCS_OK) {
    ucp_mem_unmap(context_, r.memh);
    throw UcsError(st, "ucp_rkey_pack");
  }
  r.rkey.assign(static_cast<const char*>(rkey), rkey_len);
  ucp_rkey_buffer_release(rkey);
  uint64_t id = next_id_++;
  regions_.emplace(id, std::move(r));
  return id;
}

std::string Engine::rkey(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) throw UcsError(UCS_ERR_INVALID_PARAM, "unknown region");
  return it->second.rkey;
}

void Engine::deregister_region(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return;
  if (context_ != nullptr) ucp_mem_unmap(context_, it->second.memh);
  regions_.erase(it);
}

void Engine::set_agent_id(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (id.size() != kAgentIdBytes) throw UcsError(UCS_ERR_INVALID_PARAM, "agent id of 16 bytes");
  agent_id_ = id;
}

void Engine::set_put_window(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  put_window_ = n;
}

void Engine::signal_python() {
  // Only the progress thread's completions need a wake-up: in loop mode the
  // caller drains after every progress call.
  if (notified_ || !thread_on_ || py_polling_) return;
  notified_ = true;
  uint64_t one = 1;
  ssize_t rc = ::write(notify_fd_, &one, sizeof(one));
  (void)rc;  // EAGAIN: the counter is already non-zero, Python will wake
}

Drained Engine::drain() {
  std::lock_guard<std::mutex> lock(mu_);
  Drained out;
  out.results.swap(results_);
  out.failures.swap(failures_);
  out.messages.swap(messages_);
  out.landed.swap(landed_);
  if (notified_) {
    uint64_t n = 0;
    ssize_t rc = ::read(notify_fd_, &n, sizeof(n));
    (void)rc;
    notified_ = false;
  }
  return out;
}

bool Engine::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return worker_ == nullptr;
}

void Engine::close() {
  stop_thread();
  std::lock_guard<std::mutex> lock(mu_);
  if (worker_ == nullptr) return;
  std::vector<uint64_t> ids;
  for (const auto& kv : eps_) ids.push_back(kv.first);
  for (uint64_t id : ids) disconnect_locked(id);
  // Requests still outstanding were completed (with errors) by the forced
  // closes; drain their callbacks before the worker goes.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (!ops_.empty() && std::chrono::steady_clock::now() < until) ucp_worker_progress(worker_);
  for (auto& kv : regions_) ucp_mem_unmap(context_, kv.second.memh);
  regions_.clear();
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
  closed_eps_.clear();
  ucp_cleanup(context_);
  context_ = nullptr;
  efd_ = -1;
  ops_.clear();
  sync_done_.clear();
  expects_.clear();
  expect_ids_.clear();
  peers_.clear();
  ::close(notify_fd_);
  ::close(wake_fd_);
  notify_fd_ = wake_fd_ = -1;
}

}  // namespace kvb::ucx
