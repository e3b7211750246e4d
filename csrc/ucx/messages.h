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
// Version 3: the sender field is the connection tag the receiver issued in
// the HELLO exchange (not an agent id), and a DONE names its pages (digest).
// Version 4 (written): every ABORT is answered with an ABORT_ACK once the
// answering agent stopped its sends of the request and flushed; a DONE is
// the same as in version 3, which is still read.
constexpr uint8_t kMessageVersion = 4;
constexpr uint8_t kMessageMinVersion = 3;
constexpr uint8_t kKindDone = 4;
constexpr size_t kMessageHead = 108;  // magic .. blob length
constexpr size_t kAgentIdBytes = 16;
constexpr size_t kMaxRequestId = 1024;
constexpr size_t kMaxControlMessage = 60 * 1024;

struct Done {
  std::string_view sender;  // 16 bytes: the connection tag
  std::string_view rid;     // the request id's UTF-8 bytes
  uint64_t start = 0, end = 0, l0 = 0, l1 = 0, nbytes = 0;
  uint64_t pages = 0;  // the pages digest (the `offset` field)
};

// DONE(rid, start, end, l0, l1, nbytes, pages digest) under connection tag
// `sender` (16 bytes), version 4.  Throws std::invalid_argument for a sender
// of another size or a request id longer than kMaxRequestId bytes.
std::string encode_done(std::string_view sender, std::string_view rid, uint64_t start, uint64_t end,
                        uint64_t l0, uint64_t l1, uint64_t nbytes, uint64_t pages);

// The pages digest of a DONE (docs/ucx.md, "Control messages"): XXH3-64 (seed
// 0) of u64 start, end and then, as i64, the entries
// [start / page_tokens, ceil(end / page_tokens)) of the receiver's block table
// `bt` (n entries), all little-endian.  Throws std::out_of_range when the
// table is too short.
uint64_t pages_digest(const int64_t* bt, size_t n, uint64_t start, uint64_t end,
                      uint64_t page_tokens);

// True when `data` is a well-formed DONE of version 3 or 4 (size, magic,
// version, kind and lengths as messages.py checks them); `out` then points
// into `data`.  Anything else is left to Python's decoder.
bool parse_done(const void* data, size_t length, Done* out);

}  // namespace kvb::ucx
