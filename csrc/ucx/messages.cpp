// DONE messages: little-endian, laid out as docs/ucx.md's control message table.
#include "messages.h"

#include <cstring>
#include <stdexcept>
#include <vector>

#include "xxh3.h"

namespace kvb::ucx {

namespace {

template <typename T>
void put_le(char* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

template <typename T>
T get_le(const unsigned char* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(p[i]) << (8 * i);
  return v;
}

// offsets of the header fields
constexpr size_t kOffVersion = 2, kOffKind = 3, kOffSender = 4, kOffFields = 20;
constexpr size_t kOffRidLen = 100, kOffTextLen = 102, kOffBlobLen = 104;

}  // namespace

std::string encode_done(std::string_view sender, std::string_view rid, uint64_t start, uint64_t end,
                        uint64_t l0, uint64_t l1, uint64_t nbytes, uint64_t pages) {
  if (sender.size() != kAgentIdBytes) throw std::invalid_argument("agent id must be 16 bytes");
  if (rid.size() > kMaxRequestId) throw std::invalid_argument("request id longer than 1024 bytes");
  std::string out(kMessageHead + rid.size(), '\0');
  char* p = out.data();
  put_le<uint16_t>(p, kMessageMagic);
  p[kOffVersion] = static_cast<char>(kMessageVersion);
  p[kOffKind] = static_cast<char>(kKindDone);
  std::memcpy(p + kOffSender, sender.data(), kAgentIdBytes);
  // start, end, l0, l1, nbytes, part (0), offset (the pages digest); the rest stay 0
  const uint64_t fields[7] = {start, end, l0, l1, nbytes, 0, pages};
  for (size_t i = 0; i < 7; ++i) put_le<uint64_t>(p + kOffFields + 8 * i, fields[i]);
  put_le<uint16_t>(p + kOffRidLen, static_cast<uint16_t>(rid.size()));
  std::memcpy(p + kMessageHead, rid.data(), rid.size());
  return out;
}

bool parse_done(const void* data, size_t length, Done* out) {
  if (length < kMessageHead || length > kMaxControlMessage) return false;
  const auto* p = static_cast<const unsigned char*>(data);
  if (get_le<uint16_t>(p) != kMessageMagic) return false;
  const uint8_t version = p[kOffVersion];
  if (version < kMessageMinVersion || version > kMessageVersion || p[kOffKind] != kKindDone)
    return false;
  const size_t nrid = get_le<uint16_t>(p + kOffRidLen);
  const size_t ntext = get_le<uint16_t>(p + kOffTextLen);
  const size_t nblob = get_le<uint32_t>(p + kOffBlobLen);
  if (nrid > kMaxRequestId || kMessageHead + nrid + ntext + nblob != length) return false;
  const char* c = static_cast<const char*>(data);
  out->sender = std::string_view(c + kOffSender, kAgentIdBytes);
  out->rid = std::string_view(c + kMessageHead, nrid);
  out->start = get_le<uint64_t>(p + kOffFields);
  out->end = get_le<uint64_t>(p + kOffFields + 8);
  out->l0 = get_le<uint64_t>(p + kOffFields + 16);
  out->l1 = get_le<uint64_t>(p + kOffFields + 24);
  out->nbytes = get_le<uint64_t>(p + kOffFields + 32);
  out->pages = get_le<uint64_t>(p + kOffFields + 48);
  return true;
}

uint64_t pages_digest(const int64_t* bt, size_t n, uint64_t start, uint64_t end,
                      uint64_t page_tokens) {
  if (page_tokens == 0) throw std::invalid_argument("page_tokens must be positive");
  const uint64_t first = start / page_tokens;
  const uint64_t last = end > start ? (end + page_tokens - 1) / page_tokens : first;
  if (last > n) throw std::out_of_range("block table too short for the token range");
  std::vector<char> buf(16 + 8 * (last - first));
  char* p = buf.data();
  put_le<uint64_t>(p, start);
  put_le<uint64_t>(p + 8, end);
  for (uint64_t i = first; i < last; ++i)
    put_le<uint64_t>(p + 16 + 8 * (i - first), static_cast<uint64_t>(bt[i]));
  return kvb::xxh3_64(buf.data(), buf.size());
}

}  // namespace kvb::ucx
