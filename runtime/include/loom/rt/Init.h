//===- Init.h - Deterministic parameter initialisation ----------*- C++ -*-===//
//
// One implementation for the compiler (weights.safetensors) and the runtime
// (bundles compiled with --no-weights initialise on load): a splitmix64
// stream per parameter, seeded by the seed and the parameter's name.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_INIT_H
#define LOOM_RUNTIME_INIT_H

#include "loom/rt/Bundle.h"

#include <string>
#include <vector>

namespace loom::rt {

std::vector<float> initialValues(const ParamInit &init, int64_t count, uint64_t seed,
                                 const std::string &name);

/// Writes the initial values of a parameter buffer of any float dtype.
void initialiseInto(const ParamInit &init, const Buffer &buffer, uint64_t seed,
                    const std::string &name, char *dst);

} // namespace loom::rt

#endif
