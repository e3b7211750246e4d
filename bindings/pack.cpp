// Bindings of the pack core: argument plumbing only.  Buffers arrive as
// DLPack/buffer-protocol ndarrays (numpy, torch; CPU or CUDA) without copies;
// kvbridge/pack.py validates shapes and dtypes and maps status codes.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kvbridge/pack.h"

namespace nb = nanobind;

namespace {

using Result = std::pair<int, std::string>;

Result finish(int rc) {
  if (rc == KVB_OK) return {rc, std::string()};
  return {rc, std::string(kvb_last_error())};
}

// The descriptor's memory and, once opened, its kvb_cache handle; shared by
// the Python CacheDesc and every Plan made from it.
struct CacheState {
  std::vector<void*> layer_bases;
  std::vector<void*> component_bases;
  std::vector<int64_t> component_strides;
  kvb_cache_desc desc{};
  kvb_cache* handle = nullptr;

  ~CacheState() { kvb_cache_destroy(handle); }
};

// A cache descriptor built once per cache: the pointers stay valid as long as
// the Python object that owns the tensors keeps them alive.
class CacheDesc {
 public:
  CacheDesc(std::vector<uint64_t> layer_ptrs, int32_t num_components, int32_t num_heads,
            int64_t head_bytes, int64_t page_tokens, int64_t num_pages, int64_t stride_component,
            int64_t stride_page, int64_t stride_token, int64_t stride_head, int32_t device,
            int64_t elem_bytes, std::vector<int64_t> component_strides,
            std::vector<uint64_t> component_ptrs)
      : s_(std::make_shared<CacheState>()) {
    for (uint64_t p : layer_ptrs) s_->layer_bases.push_back(reinterpret_cast<void*>(p));
    for (uint64_t p : component_ptrs) s_->component_bases.push_back(reinterpret_cast<void*>(p));
    s_->component_strides = std::move(component_strides);
    kvb_cache_desc& d = s_->desc;
    d.abi_version = KVB_ABI_VERSION;
    d.num_layers = static_cast<int32_t>(layer_ptrs.empty() && num_components > 0
                                            ? s_->component_bases.size() / num_components
                                            : s_->layer_bases.size());
    d.num_components = num_components;
    d.num_heads = num_heads;
    d.head_bytes = head_bytes;
    d.page_tokens = page_tokens;
    d.num_pages = num_pages;
    d.stride_component = stride_component;
    d.stride_page = stride_page;
    d.stride_token = stride_token;
    d.stride_head = stride_head;
    d.layer_base = s_->layer_bases.empty() ? nullptr : s_->layer_bases.data();
    d.device = device;
    d.elem_bytes = elem_bytes;
    d.component_strides = s_->component_strides.empty() ? nullptr : s_->component_strides.data();
    d.component_base = s_->component_bases.empty() ? nullptr : s_->component_bases.data();
  }
  const kvb_cache_desc* get() const { return &s_->desc; }
  const std::shared_ptr<CacheState>& state() const { return s_; }

  // Checks the descriptor once and keeps the handle (for a CUDA cache: its
  // device table).  Later calls return the first answer's success at once.
  Result open() {
    if (s_->handle != nullptr) return {KVB_OK, std::string()};
    return finish(kvb_cache_create(&s_->desc, &s_->handle));
  }

 private:
  std::shared_ptr<CacheState> s_;
};

// A checked range of one cache; keeps the cache's handle alive.
class Plan {
 public:
  Plan(std::shared_ptr<CacheState> cache, kvb_plan* plan, bool cuda)
      : cache_(std::move(cache)), plan_(plan), cuda_(cuda) {}
  ~Plan() { kvb_plan_destroy(plan_); }
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  const kvb_plan* get() const { return plan_; }
  uint64_t nbytes() const { return kvb_plan_wire_nbytes(plan_); }
  bool cuda() const { return cuda_; }
  int device() const { return cache_->desc.device; }

 private:
  std::shared_ptr<CacheState> cache_;
  kvb_plan* plan_;
  bool cuda_;
};

using Table = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using WireOut = nb::ndarray<nb::c_contig>;
using WireIn = nb::ndarray<nb::ro, nb::c_contig>;

kvb_range make_range(const Table& table, int64_t token_start, int64_t token_end,
                     int32_t layer_start, int32_t layer_end, int32_t head_start = 0,
                     int32_t head_end = 0) {
  kvb_range r{};
  r.token_start = token_start;
  r.token_end = token_end;
  r.layer_start = layer_start;
  r.layer_end = layer_end;
  r.block_table = table.data();
  r.block_table_len = static_cast<int64_t>(table.shape(0));
  r.head_start = head_start;
  r.head_end = head_end;
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

template <typename Wire>
bool wire_fits(int device, const Wire& wire, uint64_t nbytes, Result* err) {
  std::string why;
  if (!device_fits(device, wire.device_type(), wire.device_id(), &why)) {
    *err = {KVB_ERR_INVALID_ARG, why};
    return false;
  }
  if (wire.nbytes() < nbytes) {
    *err = {KVB_ERR_BUFFER_TOO_SMALL, "the wire buffer holds " + std::to_string(wire.nbytes()) +
                                          " bytes; the slice needs " + std::to_string(nbytes)};
    return false;
  }
  return true;
}

// Per call (ABI 1 entry points): used for descriptors that have no handle.
template <bool kPack, typename Wire>
Result run(const CacheDesc& desc, const Table& table, int64_t token_start, int64_t token_end,
           int32_t layer_start, int32_t layer_end, uint64_t wire_offset, Wire wire, uint64_t nbytes,
           int32_t num_threads, uint64_t stream, int32_t head_start, int32_t head_end) {
  Result err;
  if (!wire_fits(desc.get()->device, wire, nbytes, &err)) return err;
  const kvb_range r =
      make_range(table, token_start, token_end, layer_start, layer_end, head_start, head_end);
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

using PlanResult = std::tuple<int, std::string, Plan*>;

PlanResult make_plan(CacheDesc& desc, const Table& table, int64_t token_start, int64_t token_end,
                     int32_t layer_start, int32_t layer_end, int32_t head_start, int32_t head_end,
                     bool writable) {
  Result opened = desc.open();
  if (opened.first != KVB_OK) return {opened.first, opened.second, nullptr};
  const kvb_range r =
      make_range(table, token_start, token_end, layer_start, layer_end, head_start, head_end);
  kvb_plan* plan = nullptr;
  int rc;
  {
    nb::gil_scoped_release release;
    rc =
        kvb_plan_create(desc.state()->handle, &r, writable ? KVB_PLAN_WRITE : KVB_PLAN_READ, &plan);
  }
  if (rc != KVB_OK) {
    Result f = finish(rc);
    return {f.first, f.second, nullptr};
  }
  return {KVB_OK, std::string(), new Plan(desc.state(), plan, desc.get()->device >= 0)};
}

std::tuple<int, std::string, uint64_t> plan_pack(const Plan& plan, uint64_t wire_offset,
                                                 WireOut out, uint64_t nbytes, int32_t num_threads,
                                                 uint64_t stream, bool checksum) {
  Result err;
  if (!wire_fits(plan.device(), out, nbytes, &err)) return {err.first, err.second, 0};
  if (checksum && plan.cuda()) {
    return {KVB_ERR_UNAVAILABLE, "checksum in the copy is a CPU-path feature", 0};
  }
  const kvb_exec ex{num_threads, stream};
  uint64_t digest = 0;
  int rc;
  {
    nb::gil_scoped_release release;
    void* dst = out.data();
    rc = plan.cuda() ? kvb_plan_pack_cuda(plan.get(), wire_offset, dst, nbytes, &ex)
                     : kvb_plan_pack_cpu(plan.get(), wire_offset, dst, nbytes, &ex,
                                         checksum ? &digest : nullptr);
  }
  Result f = finish(rc);
  return {f.first, f.second, digest};
}

Result plan_unpack(const Plan& plan, uint64_t wire_offset, WireIn src, uint64_t nbytes,
                   int32_t num_threads, uint64_t stream, std::optional<uint64_t> expect) {
  Result err;
  if (!wire_fits(plan.device(), src, nbytes, &err)) return err;
  if (expect.has_value() && plan.cuda()) {
    return {KVB_ERR_UNAVAILABLE, "checksum in the copy is a CPU-path feature"};
  }
  const kvb_exec ex{num_threads, stream};
  int rc;
  {
    nb::gil_scoped_release release;
    const void* p = src.data();
    const uint64_t want = expect.value_or(0);
    rc = plan.cuda() ? kvb_plan_unpack_cuda(plan.get(), wire_offset, p, nbytes, &ex)
                     : kvb_plan_unpack_cpu(plan.get(), wire_offset, p, nbytes, &ex,
                                           expect.has_value() ? &want : nullptr);
  }
  return finish(rc);
}

}  // namespace

void register_pack(nb::module_& m) {
  nb::class_<CacheDesc>(m, "CacheDesc")
      .def(nb::init<std::vector<uint64_t>, int32_t, int32_t, int64_t, int64_t, int64_t, int64_t,
                    int64_t, int64_t, int64_t, int32_t, int64_t, std::vector<int64_t>,
                    std::vector<uint64_t>>(),
           nb::arg("layer_ptrs"), nb::arg("num_components"), nb::arg("num_heads"),
           nb::arg("head_bytes"), nb::arg("page_tokens"), nb::arg("num_pages"),
           nb::arg("stride_component"), nb::arg("stride_page"), nb::arg("stride_token"),
           nb::arg("stride_head"), nb::arg("device"), nb::arg("elem_bytes") = 0,
           nb::arg("component_strides") = std::vector<int64_t>(),
           nb::arg("component_ptrs") = std::vector<uint64_t>())
      .def("open", &CacheDesc::open,
           "Check the descriptor once (kvb_cache_create); returns (status, message).");

  nb::class_<Plan>(m, "Plan").def_prop_ro("nbytes", &Plan::nbytes);

  m.def("make_plan", &make_plan, nb::rv_policy::take_ownership, nb::arg("desc"),
        nb::arg("block_table").noconvert(), nb::arg("token_start"), nb::arg("token_end"),
        nb::arg("layer_start"), nb::arg("layer_end"), nb::arg("head_start"), nb::arg("head_end"),
        nb::arg("writable"),
        "Check a range once (kvb_plan_create); returns (status, message, Plan or None).");
  m.def("plan_pack", &plan_pack, nb::arg("plan"), nb::arg("wire_offset"),
        nb::arg("out").noconvert(), nb::arg("nbytes"), nb::arg("num_threads"), nb::arg("stream"),
        nb::arg("checksum"),
        "Gather wire bytes [wire_offset, +nbytes) into out; returns (status, message, xxh3).");
  m.def("plan_unpack", &plan_unpack, nb::arg("plan"), nb::arg("wire_offset"),
        nb::arg("src").noconvert(), nb::arg("nbytes"), nb::arg("num_threads"), nb::arg("stream"),
        nb::arg("expect").none(),
        "Scatter wire bytes [wire_offset, +nbytes) from src, checking their xxh3 if expect is "
        "given; returns (status, message).");

  m.def("pack", &run<true, WireOut>, nb::arg("desc"), nb::arg("block_table").noconvert(),
        nb::arg("token_start"), nb::arg("token_end"), nb::arg("layer_start"), nb::arg("layer_end"),
        nb::arg("wire_offset"), nb::arg("out").noconvert(), nb::arg("nbytes"),
        nb::arg("num_threads"), nb::arg("stream"), nb::arg("head_start") = 0,
        nb::arg("head_end") = 0,
        "Per call: gather wire bytes [wire_offset, +nbytes) into out; returns (status, message).");
  m.def("unpack", &run<false, WireIn>, nb::arg("desc"), nb::arg("block_table").noconvert(),
        nb::arg("token_start"), nb::arg("token_end"), nb::arg("layer_start"), nb::arg("layer_end"),
        nb::arg("wire_offset"), nb::arg("src").noconvert(), nb::arg("nbytes"),
        nb::arg("num_threads"), nb::arg("stream"), nb::arg("head_start") = 0,
        nb::arg("head_end") = 0,
        "Per call: scatter wire bytes [wire_offset, +nbytes) from src; returns (status, message).");
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
  m.def(
      "xxh3_64",
      [](nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu> data) {
        const void* p = data.data();
        const uint64_t n = data.nbytes();
        nb::gil_scoped_release release;
        return kvb_xxh3_64(p, n);
      },
      nb::arg("data").noconvert(), "XXH3-64 (seed 0) of a host buffer's bytes.");
  m.def("cuda_device_count", &kvb_cuda_device_count,
        "Usable CUDA devices now (0 without a driver, a GPU, or CUDA support).");
  m.def("status_name", &kvb_status_name);
  m.attr("BUILT_WITH_CUDA") = kvb_built_with_cuda() != 0;
  m.attr("ABI_VERSION") = KVB_ABI_VERSION;
}
