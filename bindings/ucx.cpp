// kvbridge._ucx: the UCX engine (csrc/ucx) for Python.  Built only where the
// UCP headers and libraries are found; kvbridge.transport.ucx reports UCX as
// unavailable, with the reason, where this module is absent.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "ucx/engine.h"
#include "ucx/messages.h"
#include "ucx/runs.h"

namespace nb = nanobind;
using kvb::ucx::CacheShape;
using kvb::ucx::Engine;
using kvb::ucx::PreparedPut;
using kvb::ucx::PutRun;
using kvb::ucx::RunPlan;
using kvb::ucx::UcsError;

using Table = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using ShapeArgs =
    std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, std::vector<uint64_t>>;

static std::string str(const nb::bytes& b) { return std::string(b.c_str(), b.size()); }

static CacheShape cache_shape(const ShapeArgs& a) {
  CacheShape s;
  std::tie(s.num_pages, s.layer_bytes, s.s_comp, s.s_page, s.s_tok, s.s_head, s.region_ids) = a;
  return s;
}

using Runs = nb::ndarray<const uint64_t, nb::shape<-1, 5>, nb::c_contig, nb::device::cpu>;

static_assert(sizeof(PutRun) == 5 * sizeof(uint64_t), "PutRun must be five packed uint64");

namespace {

// drain()'s lists as Python sees them.
nb::tuple drained_tuple(const kvb::ucx::Drained& d) {
  nb::list results, failures, messages, landed;
  for (const auto& r : d.results) results.append(nb::make_tuple(r.op_id, r.status));
  for (const auto& f : d.failures) failures.append(nb::make_tuple(f.ep_id, f.status));
  for (const auto& s : d.messages) messages.append(nb::bytes(s.data(), s.size()));
  for (const auto& l : d.landed)
    landed.append(nb::make_tuple(l.token, l.l0, l.l1, l.nbytes,
                                 nb::bytes(l.sender.data(), l.sender.size()), l.layers,
                                 l.complete));
  return nb::make_tuple(results, failures, messages, landed);
}

}  // namespace

NB_MODULE(_ucx, m) {
  m.doc() = "kvbridge UCX engine: registered regions, one-sided puts, active messages";
  m.attr("HAS_UCX") = true;

  static PyObject* ucs_error =
      PyErr_NewException("kvbridge._ucx.UcsError", PyExc_RuntimeError, nullptr);
  m.attr("UcsError") = nb::borrow(ucs_error);
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void* payload) {
        try {
          std::rethrow_exception(p);
        } catch (const UcsError& e) {
          nb::object args = nb::make_tuple(static_cast<int>(e.status()), nb::str(e.what()));
          PyErr_SetObject(static_cast<PyObject*>(payload), args.ptr());
        }
      },
      ucs_error);

  m.def("version", []() { return std::string(ucp_get_version_string()); });
  m.def(
      "encode_done",
      [](nb::bytes sender, nb::bytes rid, uint64_t start, uint64_t end, uint64_t l0, uint64_t l1,
         uint64_t nbytes, uint64_t pages) {
        std::string m =
            kvb::ucx::encode_done(str(sender), str(rid), start, end, l0, l1, nbytes, pages);
        return nb::bytes(m.data(), m.size());
      },
      nb::arg("sender"), nb::arg("rid"), nb::arg("start"), nb::arg("end"), nb::arg("l0"),
      nb::arg("l1"), nb::arg("nbytes"), nb::arg("pages") = 0,
      "The DONE message the put path sends (messages.py's twin)");
  m.def(
      "pages_digest",
      [](Table bt, uint64_t start, uint64_t end, uint64_t page_tokens) {
        return kvb::ucx::pages_digest(bt.data(), bt.shape(0), start, end, page_tokens);
      },
      nb::arg("block_table"), nb::arg("start"), nb::arg("end"), nb::arg("page_tokens"), "The pages digest a DONE names (docs/ucx.md, Control messages)");
  m.def(
      "parse_done",
      [](nb::bytes data) -> nb::object {
        kvb::ucx::Done d;
        if (!kvb::ucx::parse_done(data.c_str(), data.size(), &d)) return nb::none();
        return nb::make_tuple(nb::bytes(d.sender.data(), d.sender.size()),
                              nb::bytes(d.rid.data(), d.rid.size()), d.start, d.end, d.l0, d.l1,
                              d.nbytes, d.pages);
      },
      nb::arg("data"),
      "(sender, rid, start, end, l0, l1, nbytes, pages) of a well-formed DONE, else None");
  m.def("status_string", [](int status) {
    return std::string(ucs_status_string(static_cast<ucs_status_t>(status)));
  });
  nb::dict status;
  status["OK"] = static_cast<int>(UCS_OK);
  status["ERR_CANCELED"] = static_cast<int>(UCS_ERR_CANCELED);
  status["ERR_INVALID_PARAM"] = static_cast<int>(UCS_ERR_INVALID_PARAM);
  status["ERR_UNREACHABLE"] = static_cast<int>(UCS_ERR_UNREACHABLE);
  status["ERR_NOT_CONNECTED"] = static_cast<int>(UCS_ERR_NOT_CONNECTED);
  status["ERR_CONNECTION_RESET"] = static_cast<int>(UCS_ERR_CONNECTION_RESET);
  status["ERR_ENDPOINT_TIMEOUT"] = static_cast<int>(UCS_ERR_ENDPOINT_TIMEOUT);
  status["ERR_TIMED_OUT"] = static_cast<int>(UCS_ERR_TIMED_OUT);
  status["ERR_IO_ERROR"] = static_cast<int>(UCS_ERR_IO_ERROR);
  status["ERR_REJECTED"] = static_cast<int>(UCS_ERR_REJECTED);
  status["ERR_NO_RESOURCE"] = static_cast<int>(UCS_ERR_NO_RESOURCE);
  status["ERR_UNSUPPORTED"] = static_cast<int>(UCS_ERR_UNSUPPORTED);
  status["ERR_NO_MEMORY"] = static_cast<int>(UCS_ERR_NO_MEMORY);
  m.attr("STATUS") = status;
  m.attr("MAX_MESSAGE") = Engine::kMaxMessage;

  nb::class_<RunPlan>(m, "RunPlan")
      .def(
          "__init__",
          [](RunPlan* self, int64_t page_tokens, int64_t components, int64_t heads,
             int64_t head_bytes, bool hnd, bool kv_first, bool stacked, int64_t num_layers,
             const ShapeArgs& src, const ShapeArgs& dst) {
            new (self) RunPlan(page_tokens, components, heads, head_bytes, hnd, kv_first, stacked,
                               num_layers, cache_shape(src), cache_shape(dst));
          },
          nb::arg("page_tokens"), nb::arg("components"), nb::arg("heads"), nb::arg("head_bytes"),
          nb::arg("hnd"), nb::arg("kv_first"), nb::arg("stacked"), nb::arg("num_layers"),
          nb::arg("src"), nb::arg("dst"),
          "src, dst: (num_pages, layer_bytes, s_comp, s_page, s_tok, s_head, region ids)")
      .def(
          "runs",
          [](const RunPlan& plan, Table sbt, Table dbt, int64_t start, int64_t end, int64_t l0,
             int64_t l1) {
            std::vector<PutRun> runs;
            plan.runs(sbt.data(), sbt.shape(0), dbt.data(), dbt.shape(0), start, end, l0, l1,
                      &runs);
            auto* data = new uint64_t[runs.size() * 5];
            for (size_t i = 0; i < runs.size(); ++i) {
              const PutRun& r = runs[i];
              uint64_t* row = data + i * 5;
              row[0] = r.local_region;
              row[1] = r.local_off;
              row[2] = r.remote_region;
              row[3] = r.remote_off;
              row[4] = r.length;
            }
            nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<uint64_t*>(p); });
            return nb::ndarray<nb::numpy, uint64_t, nb::ndim<2>>(data, {runs.size(), 5}, owner);
          },
          nb::arg("src_block_table"), nb::arg("dst_block_table"), nb::arg("start"), nb::arg("end"),
          nb::arg("l0"), nb::arg("l1"),
          "The coalesced (local region, local offset, remote region, remote offset, length) rows")
      .def(
          "prepare",
          [](const RunPlan& plan, Table sbt, Table dbt, int64_t start, int64_t end, int64_t l0,
             int64_t l1) {
            return plan.prepare(sbt.data(), sbt.shape(0), dbt.data(), dbt.shape(0), start, end, l0,
                                l1);
          },
          nb::arg("src_block_table"), nb::arg("dst_block_table"), nb::arg("start"), nb::arg("end"),
          nb::arg("l0"), nb::arg("l1"),
          "The runs of a range, kept for Engine.put_prepared (a PreparedPut)");

  nb::class_<PreparedPut>(m, "PreparedPut")
      .def_ro("nbytes", &PreparedPut::nbytes)
      .def_prop_ro("runs", [](const PreparedPut& p) { return p.runs.size(); });

  nb::class_<Engine>(m, "Engine")
      .def(nb::init<const std::vector<std::pair<std::string, std::string>>&>(), nb::arg("config"))
      .def("address",
           [](const Engine& e) { return nb::bytes(e.address().data(), e.address().size()); })
      .def("event_fd", &Engine::event_fd)
      .def("set_agent_id", [](Engine& e, nb::bytes id) { e.set_agent_id(str(id)); })
      .def("set_put_window", &Engine::set_put_window, nb::arg("n"))
      .def("set_yield_us", &Engine::set_yield_us, nb::arg("us"))
      .def("poll", &Engine::poll, nb::arg("max_us"), nb::arg("token") = 0, nb::arg("yield_us") = 0,
           nb::call_guard<nb::gil_scoped_release>(),
           "Progress up to max_us; returns early (True) when something is queued for drain(), "
           "or when expectation `token` is complete")
      .def(
          "poll_take",
          [](Engine& e, unsigned max_us, uint64_t token, unsigned yield_us) {
            e.poll(max_us, token, yield_us);
            return e.take_landed(token);
          },
          nb::arg("max_us"), nb::arg("token"), nb::arg("yield_us") = 0,
          nb::call_guard<nb::gil_scoped_release>(),
          "poll(max_us, token, yield_us), then take_landed(token): the bytes of the DONEs that "
          "completed expectation `token` (taken out of drain()'s queue), -1 when nothing is "
          "queued, -2 when something else is")
      .def(
          "add_peer",
          [](Engine& e, nb::bytes tag, nb::bytes id) { e.add_peer(str(tag), str(id)); },
          nb::arg("tag"), nb::arg("agent_id"))
      .def("remove_peer", [](Engine& e, nb::bytes tag) { e.remove_peer(str(tag)); })
      .def("set_ep_tag", [](Engine& e, uint64_t ep, nb::bytes tag) { e.set_ep_tag(ep, str(tag)); })
      .def(
          "expect",
          [](Engine& e, uint64_t token, nb::bytes rid, uint64_t start, uint64_t end, uint64_t l0,
             uint64_t l1, nb::bytes sender, uint64_t pages) {
            e.expect(token, str(rid), start, end, l0, l1, str(sender), pages);
          },
          nb::arg("token"), nb::arg("rid"), nb::arg("start"), nb::arg("end"), nb::arg("l0"),
          nb::arg("l1"), nb::arg("sender"), nb::arg("pages"))
      .def("unexpect", &Engine::unexpect, nb::arg("token"))
      .def(
          "mark",
          [](Engine& e, uint64_t token, uint64_t l0, uint64_t l1, nb::bytes sender) {
            return e.mark(token, l0, l1, str(sender));
          },
          nb::arg("token"), nb::arg("l0"), nb::arg("l1"), nb::arg("sender"))
      .def("expect_state", &Engine::expect_state, nb::arg("token"))
      .def("progress", &Engine::progress, nb::call_guard<nb::gil_scoped_release>())
      .def("arm", &Engine::arm, nb::call_guard<nb::gil_scoped_release>())
      .def("start_thread", &Engine::start_thread, nb::arg("spin_us"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("stop_thread", &Engine::stop_thread, nb::call_guard<nb::gil_scoped_release>())
      .def("set_polling", &Engine::set_polling, nb::arg("on"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("notify_fd", &Engine::notify_fd)
      .def_prop_ro("threaded", &Engine::threaded)
      .def("register_region", &Engine::register_region, nb::arg("base"), nb::arg("length"))
      .def("rkey",
           [](const Engine& e, uint64_t id) {
             std::string k = e.rkey(id);
             return nb::bytes(k.data(), k.size());
           })
      .def("deregister_region", &Engine::deregister_region)
      .def(
          "connect",
          [](Engine& e, nb::bytes address,
             const std::vector<std::tuple<uint64_t, uint64_t, nb::bytes>>& regions,
             bool peer_errors) {
            std::vector<std::tuple<uintptr_t, size_t, std::string>> rs;
            for (const auto& [base, len, key] : regions)
              rs.emplace_back(static_cast<uintptr_t>(base), static_cast<size_t>(len),
                              std::string(key.c_str(), key.size()));
            return e.connect(std::string(address.c_str(), address.size()), rs, peer_errors);
          },
          nb::arg("address"), nb::arg("regions"), nb::arg("peer_errors") = true)
      .def("disconnect", &Engine::disconnect, nb::arg("ep"), nb::arg("force") = false,
           nb::call_guard<nb::gil_scoped_release>())
      .def(
          "flush_send",
          [](Engine& e, uint64_t ep, nb::bytes msg) {
            std::string m(msg.c_str(), msg.size());
            kvb::ucx::Posted p;
            {
              nb::gil_scoped_release release;
              p = e.flush_send(ep, m);
            }
            return nb::make_tuple(p.op_id, p.status);
          },
          nb::arg("ep"), nb::arg("message"),
          "Flush the endpoint (every put posted before is complete at the target), then "
          "send the message. Returns (op id, status) as send does")
      .def("cancel_ops", &Engine::cancel_ops, nb::arg("ep"), nb::arg("op_ids"),
           nb::call_guard<nb::gil_scoped_release>(),
           "Stop these put batches: runs not yet posted never are, no DONE is sent; "
           "each finishes with UCS_ERR_CANCELED. Returns how many were stopped")
      .def("endpoint_ok", &Engine::endpoint_ok)
      .def(
          "put",
          [](Engine& e, uint64_t ep, Runs runs, nb::bytes notify, unsigned spin_us) {
            std::string note(notify.c_str(), notify.size());
            const auto* data = reinterpret_cast<const PutRun*>(runs.data());
            size_t count = runs.shape(0);
            kvb::ucx::Posted p;
            {
              nb::gil_scoped_release release;
              p = e.put(ep, data, count, note, spin_us);
            }
            return nb::make_tuple(p.op_id, p.status);
          },
          nb::arg("ep"), nb::arg("runs"), nb::arg("notify"), nb::arg("spin_us") = 0,
          "Post the runs, a flush and the notification; progress up to spin_us for "
          "them. Returns (op id, status): UCS_INPROGRESS (1) while in flight")
      .def(
          "put_range",
          [](Engine& e, uint64_t ep, const RunPlan& plan, Table sbt, Table dbt, int64_t start,
             int64_t end, int64_t l0, int64_t l1, nb::bytes rid, uint64_t min_mean_run,
             unsigned spin_us) {
            std::string id = str(rid);
            thread_local std::vector<PutRun> runs;
            kvb::ucx::Posted p{0, 2};
            uint64_t nbytes = 0;
            {
              nb::gil_scoped_release release;
              nbytes = plan.runs(sbt.data(), sbt.shape(0), dbt.data(), dbt.shape(0), start, end, l0,
                                 l1, &runs);
              bool tiny = !runs.empty() && nbytes / runs.size() < min_mean_run;
              if (!tiny) {
                uint64_t pages = kvb::ucx::pages_digest(
                    dbt.data(), dbt.shape(0), static_cast<uint64_t>(start),
                    static_cast<uint64_t>(end), static_cast<uint64_t>(plan.page_tokens()));
                std::string note = kvb::ucx::encode_done(
                    e.ep_tag(ep), id, static_cast<uint64_t>(start), static_cast<uint64_t>(end),
                    static_cast<uint64_t>(l0), static_cast<uint64_t>(l1), nbytes, pages);
                p = e.put(ep, runs.data(), runs.size(), note, spin_us);
              }
            }
            return nb::make_tuple(p.op_id, p.status, runs.size(), nbytes);
          },
          nb::arg("ep"), nb::arg("plan"), nb::arg("src_block_table"), nb::arg("dst_block_table"),
          nb::arg("start"), nb::arg("end"), nb::arg("l0"), nb::arg("l1"), nb::arg("rid"),
          nb::arg("min_mean_run"), nb::arg("spin_us"),
          "Compute the runs of a range with `plan` and put them, then DONE(rid) from this "
          "endpoint's connection tag (see put). Returns (op id, status, runs, bytes); status 2: the mean "
          "run is below min_mean_run, nothing posted")
      .def(
          "put_prepared",
          [](Engine& e, uint64_t ep, const PreparedPut& prep, nb::bytes rid, unsigned spin_us) {
            std::string id = str(rid);
            kvb::ucx::Posted p;
            {
              nb::gil_scoped_release release;
              std::string note = kvb::ucx::encode_done(e.ep_tag(ep), id, prep.start, prep.end,
                                                       prep.l0, prep.l1, prep.nbytes, prep.pages);
              p = e.put(ep, prep.runs.data(), prep.runs.size(), note, spin_us);
            }
            return nb::make_tuple(p.op_id, p.status);
          },
          nb::arg("ep"), nb::arg("prepared"), nb::arg("rid"), nb::arg("spin_us"),
          "Put a PreparedPut's runs, then DONE(rid) from this engine's agent id (see put). "
          "Returns (op id, status)")
      .def(
          "send",
          [](Engine& e, uint64_t ep, nb::bytes msg, bool report) {
            std::string m(msg.c_str(), msg.size());
            kvb::ucx::Posted p;
            {
              nb::gil_scoped_release release;
              p = e.send(ep, m, report);
            }
            return nb::make_tuple(p.op_id, p.status);
          },
          nb::arg("ep"), nb::arg("message"), nb::arg("report") = true)
      .def("drain",
           [](Engine& e) {
             kvb::ucx::Drained d;
             {
               nb::gil_scoped_release release;
               d = e.drain();
             }
             return drained_tuple(d);
           })
      .def(
          "poll_drain",
          [](Engine& e, unsigned max_us, unsigned yield_us) -> nb::object {
            kvb::ucx::Drained d;
            {
              nb::gil_scoped_release release;
              if (!e.poll(max_us, 0, yield_us)) return nb::none();
              d = e.drain();
            }
            return drained_tuple(d);
          },
          nb::arg("max_us"), nb::arg("yield_us") = 0,
          "poll(max_us, 0, yield_us), then drain() when it found something: drain()'s tuple, "
          "or None")
      .def("close", &Engine::close, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("closed", &Engine::closed);
}
