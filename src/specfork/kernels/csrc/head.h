// The draft head's layer (specfork.heads) in one call per step: see head.cpp.
#pragma once
#include <torch/extension.h>

namespace sf {

// Registers FastHead in the kernels' Python module.
void bind_head(pybind11::module_& m);

}  // namespace sf
