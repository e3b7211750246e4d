// Bindings of the pack core: argument plumbing only.  Buffers arrive as
// DLPack/buffer-protocol ndarrays (numpy, torch; CPU or CUDA) without copies;
// kvbridge/pack.py validates shapes and dtypes and maps status codes.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvbridge/pack.h"

namespace nb = nanobind;

namespace {

// A cache descriptor built once per cache: the layer pointers stay valid as
// long as the Python object that owns the tensors keeps them alive.
class CacheDesc {
 public:
  CacheDesc(std::vector<uint64_t> layer_ptrs, int32_t num_components, int32_t num_heads,
            int64_t head_bytes, int64_t page_tokens, int64_t num_pages, int64_t stride_component,
            int64_t stride_page, int64_t stride_token, int64_t stride_head, int32_t device) {
    for (uint64_t p : layer_ptrs) bases_.push_back(reinterpret_cast<void*>(p));
    desc_.abi_version = KVB_ABI_VERSION;
    desc_.num_layers = static_cast<int32_t>(bases_.size());
    desc_.num_components = num_components;
    desc_.num_heads = num_heads;
    desc_.head_bytes = head_bytes;
    desc_.page_tokens = page_tokens;
    desc_.num_pages = num_pages;
    desc_.stride_component = stride_component;
    desc_.stride_page = stride_page;
    desc_.stride_token = stride_token;
    desc_.stride_head = stride_head;
    desc_.layer_base = bases_.data();
    desc_.device = device;
  }
  const kvb_cache_desc* get() const { return &desc_; }

 private:
  std::vector<void*> bases_;
  kvb_cache_desc desc_{};
};

using Table = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using WireOut = nb::ndarray<nb::c_contig>;
using WireIn = nb::ndarray<nb::ro, nb::c_contig>;
using Result = std::pair<int, std::string>;

kvb_range make_range(const Table& table, int64_t token_start, int64_t token_end,
                     int32_t layer_start, int32_t layer_end) {
  kvb_range r{};
  r.token_start = token_start;
  r.token_end = token_end;
  r.layer_start = layer_start;
  r.layer_end = layer_end;
  r.block_table = table.data();
  r.block_table_len = static_cast<int64_t>(table.shape(0));
  return r;
}

// The wire buffer must live where the path can reach it.
bool device_fits(int cache_device, int32_t type, int32_t id, std::string* why) {
  if (cache_device < 0) {
    if (type == nb::device::cpu::value) return true;
    *why = "a host-memory cache needs a host wire buffer";
    return false;
  }
  if (type == nb::device::cpu::value || type == nb::device::cuda_host::value) return true;
  if (type == nb::device::cuda::value && id == cache_device) return true;
  *why = "the wire buffer is not on the cache's CUDA device (nor in host memory)";
  return false;
}

Result finish(int rc) {
  if (rc == KVB_OK) return {rc, std::string()};
  return {rc, std::string(kvb_last_error())};
}

template <bool kPack, typename Wire>
Result run(const CacheDesc& desc, const Table& table, int64_t token_start, int64_t token_end,
           int32_t layer_start, int32_t layer_end, uint64_t wire_offset, Wire wire, uint64_t nbytes,
           int32_t num_threads, uint64_t stream) {
  std::string why;
  if (!device_fits(desc.get()->device, wire.device_type(), wire.device_id(), &why)) {
    return {KVB_ERR_INVALID_ARG, why};
  }
  if (wire.nbytes() < nbytes) {
    return {KVB_ERR_BUFFER_TOO_SMALL, "the wire buffer holds " + std::to_string(wire.nbytes()) +
                                          " bytes; the slice needs " + std::to_string(nbytes)};
  }
  const kvb_range r = make_range(table, token_start, token_end, layer_start, layer_end);
  const kvb_exec ex{num_threads, stream};
  const bool cuda = desc.get()->device >= 0;
  int rc;
  {
    nb::gil_scoped_release release;
    if constexpr (kPack) {
      void* dst = wire.data();
      rc = cuda ? kvb_pack_cuda(desc.get(), &r, wire_offset, dst, nbytes, &ex)
                : kvb_pack_cpu(desc.get(), &r, wire_offset, dst, nbytes, &ex);
    } else {
      const void* src = wire.data();
      rc = cuda ? kvb_unpack_cuda(desc.get(), &r, wire_offset, src, nbytes, &ex)
                : kvb_unpack_cpu(desc.get(), &r, wire_offset, src, nbytes, &ex);
    }
  }
  return finish(rc);
}

}  // namespace

void register_pack(nb::module_& m) {
  nb::class_<CacheDesc>(m, "CacheDesc")
      .def(nb::init<std::vector<uint64_t>, int32_t, int32_t, int64_t, int64_t, int64_t, int64_t,
                    int64_t, int64_t, int64_t, int32_t>(),
           nb::arg("layer_ptrs"), nb::arg("num_components"), nb::arg("num_heads"),
           nb::arg("head_bytes"), nb::arg("page_tokens"), nb::arg("num_pages"),
           nb::arg("stride_component"), nb::arg("stride_page"), nb::arg("stride_token"),
           nb::arg("stride_head"), nb::arg("device"));

  m.def("pack", &run<true, WireOut>, nb::arg("desc"), nb::arg("block_table").noconvert(),
        nb::arg("token_start"), nb::arg("token_end"), nb::arg("layer_start"), nb::arg("layer_end"),
        nb::arg("wire_offset"), nb::arg("out").noconvert(), nb::arg("nbytes"),
        nb::arg("num_threads"), nb::arg("stream"),
        "Gather wire bytes [wire_offset, +nbytes) into out; returns (status, message).");
  m.def("unpack", &run<false, WireIn>, nb::arg("desc"), nb::arg("block_table").noconvert(),
        nb::arg("token_start"), nb::arg("token_end"), nb::arg("layer_start"), nb::arg("layer_end"),
        nb::arg("wire_offset"), nb::arg("src").noconvert(), nb::arg("nbytes"),
        nb::arg("num_threads"), nb::arg("stream"),
        "Scatter wire bytes [wire_offset, +nbytes) from src; returns (status, message).");
  m.def(
      "validate",
      [](const CacheDesc& desc, const Table& table, int64_t token_start, int64_t token_end,
         int32_t layer_start, int32_t layer_end, uint64_t wire_offset, uint64_t nbytes) {
        const kvb_range r = make_range(table, token_start, token_end, layer_start, layer_end);
        return finish(kvb_validate(desc.get(), &r, wire_offset, nbytes));
      },
      nb::arg("desc"), nb::arg("block_table").noconvert(), nb::arg("token_start"),
      nb::arg("token_end"), nb::arg("layer_start"), nb::arg("layer_end"), nb::arg("wire_offset"),
      nb::arg("nbytes"));
  m.def(
      "wire_nbytes",
      [](const CacheDesc& desc, int64_t token_start, int64_t token_end, int32_t layer_start,
         int32_t layer_end) {
        kvb_range r{};
        r.token_start = token_start;
        r.token_end = token_end;
        r.layer_start = layer_start;
        r.layer_end = layer_end;
        return kvb_wire_nbytes(desc.get(), &r);
      },
      nb::arg("desc"), nb::arg("token_start"), nb::arg("token_end"), nb::arg("layer_start"),
      nb::arg("layer_end"));
  m.def("cuda_device_count", &kvb_cuda_device_count,
        "Usable CUDA devices now (0 without a driver, a GPU, or CUDA support).");
  m.def("status_name", &kvb_status_name);
  m.attr("BUILT_WITH_CUDA") = kvb_built_with_cuda() != 0;
  m.attr("ABI_VERSION") = KVB_ABI_VERSION;
}
