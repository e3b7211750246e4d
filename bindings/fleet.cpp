// Bindings of the fleet router core (csrc/fleet/): argument plumbing only;
// kvbridge/fleet/core.py is the API.  Page hashes arrive as a sequence of
// 16-byte bytes objects and are read in place.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <vector>

#include "fleet/fleet_core.h"

namespace nb = nanobind;
using kvb::fleet::FleetCore;
using kvb::fleet::Key;

namespace {

void read_keys(nb::handle seq, std::vector<Key>& out) {
  PyObject* fast = PySequence_Fast(seq.ptr(), "page hashes must be a sequence of bytes");
  if (fast == nullptr) throw nb::python_error();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  out.resize(size_t(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = items[i];
    if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) != 16) {
      Py_DECREF(fast);
      out.clear();
      throw nb::value_error("a page hash is 16 bytes");
    }
    std::memcpy(&out[size_t(i)], PyBytes_AS_STRING(o), 16);
  }
  Py_DECREF(fast);
}

}  // namespace

void register_fleet(nb::module_& m) {
  nb::class_<FleetCore>(m, "FleetCore")
      .def(nb::init<double, int64_t>(), nb::arg("load_factor"), nb::arg("max_pages"))
      .def("add", &FleetCore::add)
      .def("update", &FleetCore::update)
      .def("remove", &FleetCore::remove)
      .def("eject", &FleetCore::eject)
      .def("note",
           [](FleetCore& c, int slot, nb::handle hashes) {
             std::vector<Key> keys;
             read_keys(hashes, keys);
             c.note(slot, keys);
           })
      .def("choose",
           [](FleetCore& c, nb::handle hashes, int kept, int64_t page_tokens) {
             read_keys(hashes, c.pages_buffer());
             int out[4];
             c.choose(kept, page_tokens, out);
             return nb::make_tuple(out[0], out[1], out[2], out[3]);
           })
      .def("commit", &FleetCore::commit)
      .def("prefilled", &FleetCore::prefilled)
      .def("finish", &FleetCore::finish)
      .def("load", &FleetCore::load)
      .def("least", &FleetCore::least)
      .def("members", &FleetCore::members)
      .def("active", &FleetCore::active)
      .def("queued", &FleetCore::queued)
      .def("index_size", &FleetCore::index_size)
      .def("pages", [](const FleetCore& c, int slot) {
        std::vector<Key> keys = c.pages(slot);
        nb::list out;
        for (const Key& k : keys)
          out.append(nb::steal(PyBytes_FromStringAndSize(reinterpret_cast<const char*>(&k), 16)));
        return out;
      });
}
