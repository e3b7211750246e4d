// Context, worker, progress, regions and active-message receipt.
#include "engine.h"

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
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(context_, &wp, &worker_);
  if (st != UCS_OK) {
    ucp_cleanup(context_);
    context_ = nullptr;
    throw UcsError(st, "ucp_worker_create");
  }
  auto fail = [this](ucs_status_t s, const char* what) {
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

unsigned Engine::progress() {
  if (worker_ == nullptr) return 0;
  unsigned total = 0;
  for (int i = 0; i < 4096; ++i) {
    unsigned n = ucp_worker_progress(worker_);
    total += n;
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

bool Engine::arm() {
  if (worker_ == nullptr) return true;
  ucs_status_t st = ucp_worker_arm(worker_);
  if (st == UCS_ERR_BUSY) return false;
  if (st != UCS_OK) throw UcsError(st, "ucp_worker_arm");
  return true;
}

uint64_t Engine::register_region(uintptr_t base, size_t length) {
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

const Region& Engine::region(uint64_t id) const {
  auto it = regions_.find(id);
  if (it == regions_.end()) throw UcsError(UCS_ERR_INVALID_PARAM, "unknown region");
  return it->second;
}

void Engine::deregister_region(uint64_t id) {
  auto it = regions_.find(id);
  if (it == regions_.end()) return;
  if (context_ != nullptr) ucp_mem_unmap(context_, it->second.memh);
  regions_.erase(it);
}

void Engine::on_message(const void* data, size_t length) {
  messages_.emplace_back(static_cast<const char*>(data), length);
}

std::vector<OpResult> Engine::take_results() {
  std::vector<OpResult> out;
  out.swap(results_);
  return out;
}

std::vector<EpFailure> Engine::take_failures() {
  std::vector<EpFailure> out;
  out.swap(failures_);
  return out;
}

std::vector<std::string> Engine::take_messages() {
  std::vector<std::string> out;
  out.swap(messages_);
  return out;
}

void Engine::close() {
  if (worker_ == nullptr) return;
  std::vector<uint64_t> ids;
  for (const auto& kv : eps_) ids.push_back(kv.first);
  for (uint64_t id : ids) disconnect(id);
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
}

}  // namespace kvb::ucx
