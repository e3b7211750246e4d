// The DONE control message of docs/ucx.md ("Control messages"), in C++: the
// put path encodes it without Python, and a receiver parses it on arrival so
// that an expected request lands without Python.  The twin, for this one kind,
// of kvbridge/transport/ucx/messages.py (which stays the reference the tests
// compare against).  Pure: no UCX.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvb::ucx {

constexpr uint16_t kMessageMagic = 0x4B55;
constexpr uint8_t kMessageVersion = 2;
constexpr uint8_t kMessageMinVersion = 1;
constexpr uint8_t kKindDone = 4;
constexpr size_t kMessageHead = 108;  // magic .. blob length
constexpr size_t kAgentIdBytes = 16;
constexpr size_t kMaxRequestId = 1024;
constexpr size_t kMaxControlMessage = 60 * 1024;

struct Done {
  std::string_view sender;  // 16 bytes
  std::string_view rid;     // the request id's UTF-8 bytes
  uint64_t start = 0, end = 0, l0 = 0, l1 = 0, nbytes = 0;
};

// DONE(rid, start, end, l0, l1, nbytes) from `sender` (16 bytes), version 2.
// Throws std::invalid_argument for a sender of another size or a request id
// longer than kMaxRequestId bytes.
std::string encode_done(std::string_view sender, std::string_view rid, uint64_t start, uint64_t end,
                        uint64_t l0, uint64_t l1, uint64_t nbytes);

// True when `data` is a well-formed DONE of version 1 or 2 (size, magic,
// version, kind and lengths as messages.py checks them); `out` then points
// into `data`.  Anything else is left to Python's decoder.
bool parse_done(const void* data, size_t length, Done* out);

}  // namespace kvb::ucx
