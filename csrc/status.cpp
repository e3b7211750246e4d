// Status names and the thread-local last-error message.
#include <cstdarg>
#include <cstdio>
#include <string>

#include "error.h"
#include "kvbridge/status.h"

namespace kvb {
namespace {
thread_local std::string g_last_error;  // NOLINT: per-thread by design
}

int fail(int status, const std::string& message) {
  try {
    g_last_error = message;
  } catch (...) {
    // Out of memory while recording the message: keep the status.
  }
  return status;
}

int failf(int status, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return fail(status, buf);
}

}  // namespace kvb

extern "C" const char* kvb_last_error(void) { return kvb::g_last_error.c_str(); }

extern "C" const char* kvb_status_name(int status) {
  switch (status) {
    case KVB_OK:
      return "KVB_OK";
    case KVB_IN_PROGRESS:
      return "KVB_IN_PROGRESS";
    case KVB_ERR_INVALID_ARG:
      return "KVB_ERR_INVALID_ARG";
    case KVB_ERR_OUT_OF_RANGE:
      return "KVB_ERR_OUT_OF_RANGE";
    case KVB_ERR_BUFFER_TOO_SMALL:
      return "KVB_ERR_BUFFER_TOO_SMALL";
    case KVB_ERR_DTYPE:
      return "KVB_ERR_DTYPE";
    case KVB_ERR_SHAPE:
      return "KVB_ERR_SHAPE";
    case KVB_ERR_OVERLAP:
      return "KVB_ERR_OVERLAP";
    case KVB_ERR_LAYOUT:
      return "KVB_ERR_LAYOUT";
    case KVB_ERR_UNAVAILABLE:
      return "KVB_ERR_UNAVAILABLE";
    case KVB_ERR_CUDA:
      return "KVB_ERR_CUDA";
    case KVB_ERR_INTERNAL:
      return "KVB_ERR_INTERNAL";
    case KVB_ERR_TIMEOUT:
      return "KVB_ERR_TIMEOUT";
    case KVB_ERR_CANCELLED:
      return "KVB_ERR_CANCELLED";
    case KVB_ERR_PEER:
      return "KVB_ERR_PEER";
    case KVB_ERR_INCOMPATIBLE:
      return "KVB_ERR_INCOMPATIBLE";
    case KVB_ERR_CHECKSUM:
      return "KVB_ERR_CHECKSUM";
    default:
      return "KVB_UNKNOWN_STATUS";
  }
}
