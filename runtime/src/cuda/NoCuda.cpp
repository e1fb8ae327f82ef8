//===- NoCuda.cpp - The CUDA backend in a build without CUDA --------------===//

#include "runtime/src/Backend.h"
#include "loom/rt/Error.h"

namespace loom::rt {

std::shared_ptr<NcclWorld> makeNcclWorld(const Manifest &, const std::vector<int> &, int, Communicator *,
                                         double) {
  fail(LOOM_UNSUPPORTED, "this runtime was built without CUDA, so multi-GPU bundles cannot run; "
       "use --backend cpu");
}
void abortNcclWorld(NcclWorld &, const std::string &) {}
std::string describePeerLinks(const NcclWorld &) { return ""; }
std::vector<DeferredPart> deferredParts(const RankProgram &) { return {}; }
size_t deferredBytes(const std::vector<DeferredPart> &) { return 0; }

std::unique_ptr<Backend> makeCudaBackend(const RankProgram &, int, NcclWorld *, const std::string &) {
  fail(LOOM_UNSUPPORTED, "this runtime was built without CUDA (no CUDA compiler was found when "
       "it was configured); rebuild on a machine with the CUDA toolkit, or use --backend cpu");
}

} // namespace loom::rt
