//===- BundleWriter.cpp - Write the lowered step as a bundle --------------===//
//
// Runs the loom-compile pipeline on a copy of the model and writes what it
// leaves: the manifest, the weights (initialised from the seed or taken
// from a file) and the PTX of the generated kernels.
//
//===----------------------------------------------------------------------===//

#include "compiler/bundle/BundleWriter.h"
#include "compiler/Pipeline.h"
#include "compiler/bundle/KernelGen.h"
#include "runtime/src/Error.h"
#include "runtime/src/Init.h"
#include "runtime/src/Safetensors.h"

#include <cstring>
#include <optional>
#include <set>
#include <sys/stat.h>

using namespace mlir;
using namespace mlir::loom;
namespace rt = ::loom::rt;

FailureOr<rt::Manifest> mlir::loom::lowerForward(ModuleOp original, const BundleOptions &options) {
  OwningOpRef<ModuleOp> module(original.clone());
  PassManager pm(original.getContext(), ModuleOp::getOperationName());
  buildCompilePipeline(pm, options);
  if (failed(pm.run(*module)))
    return failure();
  FailureOr<Step> step = readStep(*module, "the bundle writer");
  if (failed(step))
    return failure();
  return toManifest(*step);
}

LogicalResult mlir::loom::writeBundle(ModuleOp module, const BundleOptions &options,
                                      const std::string &dir, rt::Manifest *out) {
  FailureOr<rt::Manifest> manifest = lowerForward(module, options);
  if (failed(manifest))
    return failure();
  try {
    std::vector<std::vector<char>> storage;
    std::vector<rt::SafetensorsTensorRef> refs;
    std::optional<rt::SafetensorsFile> given;
    if (!options.weightsFile.empty())
      given = rt::readSafetensors(options.weightsFile);
    // The weights file holds every parameter whole, as one device has it;
    // each rank takes its own parameters, or its part of a split one.
    std::vector<std::pair<rt::Parameter, rt::Buffer>> all;
    std::set<std::string> seen;
    for (const rt::RankProgram &rank : manifest->ranks)
      for (const rt::Parameter &p : rank.params)
        if (seen.insert(p.name).second) {
          rt::Buffer b = rank.buffers[p.buffer];
          if (p.shard.axis >= 0) {
            b.shape = p.shard.fullShape;
            b.bytes *= p.shard.parts;
          }
          all.push_back({p, b});
        }
    storage.reserve(all.size());
    for (const auto &[p, b] : all) {
      if (options.noWeights)
        break;
      storage.emplace_back(static_cast<size_t>(b.bytes));
      char *dst = storage.back().data();
      if (given) {
        auto it = given->tensors.find(p.name);
        if (it == given->tensors.end())
          return module.emitError() << options.weightsFile << ": parameter '" << p.name
                                    << "' is missing";
        if (it->second.dtype != b.dtype || it->second.shape != b.shape)
          return module.emitError()
                 << options.weightsFile << ": parameter '" << p.name << "' is "
                 << rt::dtypeName(it->second.dtype) << rt::shapeStr(it->second.shape)
                 << " but the model declares " << rt::dtypeName(b.dtype) << rt::shapeStr(b.shape);
        std::memcpy(dst, given->data.data() + it->second.offset, b.bytes);
      } else {
        rt::initialiseInto(p.init, b, options.seed, p.name, dst);
      }
      refs.push_back({p.name, b.dtype, b.shape, dst, static_cast<size_t>(b.bytes)});
    }
    if (options.fuse) { // one PTX module with every rank's fused kernels
      std::string error;
      FailureOr<std::string> ptx = fusedKernelsPtx(manifest->ranks, error);
      if (failed(ptx))
        return emitError(module.getLoc()) << error;
      if (!ptx->empty()) {
        manifest->kernels = "kernels.ptx";
        ::mkdir(dir.c_str(), 0755);
        rt::writeFileAtomically(dir + "/kernels.ptx", ptx->data(), ptx->size());
      }
    }
    if (options.noWeights) {
      manifest->weights = ""; // the runtime initialises from the seed
      rt::writeManifest(*manifest, dir);
    } else {
      rt::writeManifest(*manifest, dir);
      rt::writeSafetensors(dir + "/" + manifest->weights, refs,
                           {{"model", options.modelName}, {"seed", std::to_string(options.seed)}});
    }
  } catch (const rt::Error &e) {
    return module.emitError() << e.what();
  }
  if (out)
    *out = std::move(*manifest);
  return success();
}
