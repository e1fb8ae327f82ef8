//===- NoCuda.cpp - The CUDA backend in a build without CUDA --------------===//

#include "runtime/src/Backend.h"
#include "runtime/src/Error.h"

namespace loom::rt {

std::unique_ptr<Backend> makeCudaBackend(const RankProgram &, int) {
  fail(LOOM_UNSUPPORTED, "this runtime was built without CUDA (no CUDA compiler was found when "
       "it was configured); rebuild on a machine with the CUDA toolkit, or use --backend cpu");
}

} // namespace loom::rt
