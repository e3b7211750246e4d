// The receiving side's expectations: a DONE for an expected request lands in
// C++ the moment its active message arrives (in whichever thread progresses
// the worker), and Python only accounts it; every other message goes to
// Python as it came.
#include <algorithm>
#include <string_view>

#include "engine.h"
#include "messages.h"

namespace kvb::ucx {

void Engine::add_peer(const std::string& tag, const std::string& agent_id) {
  std::lock_guard<std::mutex> lock(mu_);
  peers_[tag] = agent_id;
}

void Engine::remove_peer(const std::string& tag) {
  std::lock_guard<std::mutex> lock(mu_);
  peers_.erase(tag);
}

void Engine::set_ep_tag(uint64_t ep_id, const std::string& tag) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tag.size() != kAgentIdBytes) throw UcsError(UCS_ERR_INVALID_PARAM, "tag of 16 bytes");
  endpoint(ep_id).tag = tag;
}

std::string Engine::ep_tag(uint64_t ep_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = eps_.find(ep_id);
  if (it == eps_.end()) throw UcsError(UCS_ERR_INVALID_PARAM, "unknown or closed endpoint");
  return it->second->tag;
}

void Engine::expect(uint64_t token, const std::string& rid, uint64_t start, uint64_t end,
                    uint64_t l0, uint64_t l1, const std::string& sender, uint64_t pages) {
  std::lock_guard<std::mutex> lock(mu_);
  if (l1 < l0 || end < start) throw UcsError(UCS_ERR_INVALID_PARAM, "bad expected range");
  if (expects_.count(token) || expect_ids_.count(rid))
    throw UcsError(UCS_ERR_INVALID_PARAM, "request already expected");
  Expectation e;
  e.token = token;
  e.rid = rid;
  e.start = start;
  e.end = end;
  e.l0 = l0;
  e.l1 = l1;
  e.sender = sender;
  e.pages = pages;
  e.landed.assign(l1 - l0, 0);
  e.missing = l1 - l0;
  expect_ids_.emplace(rid, token);
  expects_.emplace(token, std::move(e));
}

void Engine::unexpect(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = expects_.find(token);
  if (it == expects_.end()) return;
  expect_ids_.erase(it->second.rid);
  expects_.erase(it);
}

namespace {

// Mark layers [l0, l1) of `e` (inside its range); returns how many were new.
uint64_t mark_layers(Expectation& e, uint64_t l0, uint64_t l1) {
  uint64_t fresh = 0;
  for (uint64_t l = l0; l < l1; ++l) {
    uint8_t& f = e.landed[l - e.l0];
    if (!f) {
      f = 1;
      ++fresh;
    }
  }
  e.missing -= fresh;
  return fresh;
}

}  // namespace

int64_t Engine::mark(uint64_t token, uint64_t l0, uint64_t l1, const std::string& sender) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = expects_.find(token);
  if (it == expects_.end()) return -1;
  Expectation& e = it->second;
  if (l0 < e.l0 || l1 > e.l1 || l1 < l0)
    throw UcsError(UCS_ERR_INVALID_PARAM, "layers outside the expected range");
  if (e.sender.empty()) e.sender = sender;
  mark_layers(e, l0, l1);
  return static_cast<int64_t>(e.landed.size() - e.missing);
}

std::pair<int64_t, bool> Engine::expect_state(uint64_t token) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = expects_.find(token);
  if (it == expects_.end()) return {-1, false};
  const Expectation& e = it->second;
  return {static_cast<int64_t>(e.landed.size() - e.missing), e.missing == 0};
}

bool Engine::apply_done(const void* data, size_t length) {
  Done d;
  if (expects_.empty() || !parse_done(data, length, &d)) return false;
  auto id = expect_ids_.find(std::string(d.rid));
  if (id == expect_ids_.end()) return false;
  Expectation& e = expects_.at(id->second);
  // Python decides everything that is not a plain part of an expected
  // request: an unknown tag (dropped there), another peer's part, other
  // tokens, layers or pages (refused there).  The sender is the agent the
  // tag was issued to, never what the message says.
  auto peer = peers_.find(std::string(d.sender));
  if (peer == peers_.end()) return false;
  const std::string& from = peer->second;
  if (!e.sender.empty() && e.sender != from) return false;
  if (d.start != e.start || d.end != e.end || d.l0 < e.l0 || d.l1 > e.l1 || d.l1 < d.l0 ||
      d.pages != e.pages)
    return false;
  if (e.sender.empty()) e.sender = from;
  mark_layers(e, d.l0, d.l1);
  landed_.push_back(
      {e.token, d.l0, d.l1, d.nbytes, e.sender, e.landed.size() - e.missing, e.missing == 0});
  if (e.missing == 0) {  // complete: reported as such, and forgotten here (Python drops it)
    expects_.erase(id->second);
    expect_ids_.erase(id);
  }
  return true;
}

void Engine::on_message(const void* data, size_t length) {
  if (!apply_done(data, length)) messages_.emplace_back(static_cast<const char*>(data), length);
  signal_python();
}

int64_t Engine::take_landed(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  bool complete = false;
  uint64_t bytes = 0;
  for (const Landed& l : landed_) {
    if (l.token == token) {
      bytes += l.nbytes;
      complete = complete || l.complete;
    }
  }
  if (!complete) return python_work() ? -2 : -1;
  landed_.erase(std::remove_if(landed_.begin(), landed_.end(),
                               [token](const Landed& l) { return l.token == token; }),
                landed_.end());
  return static_cast<int64_t>(bytes);
}

bool Engine::expect_done(uint64_t token) const {
  auto it = expects_.find(token);
  return it == expects_.end() || it->second.missing == 0;
}

bool Engine::python_work() const {
  return !results_.empty() || !failures_.empty() || !messages_.empty() || !landed_.empty();
}

}  // namespace kvb::ucx
