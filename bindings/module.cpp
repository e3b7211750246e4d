// kvbridge._core: registers each subsystem's bindings.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void register_pack(nb::module_& m);

NB_MODULE(_core, m) {
  m.doc() = "kvbridge C++/CUDA core (thin bindings; use kvbridge.pack)";
  register_pack(m);
}
