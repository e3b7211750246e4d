// kvbridge._core: registers each subsystem's bindings.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void register_pack(nb::module_& m);
void register_fleet(nb::module_& m);

NB_MODULE(_core, m) {
  m.doc() = "kvbridge C++/CUDA core (thin bindings; use kvbridge.pack, kvbridge.fleet)";
  register_pack(m);
  register_fleet(m);
}
