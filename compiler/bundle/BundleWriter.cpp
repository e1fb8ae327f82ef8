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
#include "loom/rt/Checked.h"
#include "loom/rt/Error.h"
#include "loom/rt/Init.h"
#include "loom/rt/Safetensors.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <optional>
#include <set>
#include <sys/stat.h>
#include <unistd.h>

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

namespace {
/// Puts the bundle written to `staged` at `dir` in one step, so a kill at any
/// moment leaves the old bundle or the new one there, whole, never a mix.
void replaceBundle(const std::string &staged, const std::string &dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    // Only a bundle (or an empty directory) is replaced: `-o ~` must not
    // delete a home directory.
    if (!fs::is_directory(dir, ec) ||
        (!fs::is_empty(dir, ec) && !fs::exists(fs::path(dir) / "manifest.json", ec)))
      rt::fail(LOOM_IO_ERROR, "'", dir, "' exists and is not a bundle directory; refusing to "
               "replace it (remove it, or write the bundle elsewhere)");
  }
  // Swap the two directories atomically; then the staging name holds the old bundle.
  if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(staged, ec);
    return;
  }
  if (errno == ENOENT) { // no old bundle
    if (std::rename(staged.c_str(), dir.c_str()) != 0)
      rt::fail(LOOM_IO_ERROR, "cannot rename '", staged, "' to '", dir, "': ", std::strerror(errno));
    return;
  }
  // A file system without the exchange: move the old bundle aside first. A
  // kill in between leaves it whole at DIR.tmp-PID.old.
  std::string aside = staged + ".old";
  if (std::rename(dir.c_str(), aside.c_str()) != 0 || std::rename(staged.c_str(), dir.c_str()) != 0)
    rt::fail(LOOM_IO_ERROR, "cannot replace '", dir, "' with '", staged, "': ", std::strerror(errno));
  fs::remove_all(aside, ec);
}
} // namespace

LogicalResult mlir::loom::writeBundle(ModuleOp module, const BundleOptions &options,
                                      const std::string &bundleDir, rt::Manifest *out) {
  FailureOr<rt::Manifest> manifest = lowerForward(module, options);
  if (failed(manifest))
    return failure();
  // Errors about the output directory and the weights file are at no line
  // of the model.
  Location nowhere = UnknownLoc::get(module.getContext());
  // Everything goes to a staging directory beside the bundle, which then
  // replaces it as a unit; the staging directories of killed compiles go.
  rt::removeStaleTemporaries(bundleDir);
  const std::string dir = rt::temporaryPath(bundleDir);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  struct RemoveStaging {
    const std::string &dir;
    ~RemoveStaging() {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  } removeStaging{dir};
  try {
    if (::mkdir(dir.c_str(), 0755) != 0)
      rt::fail(LOOM_IO_ERROR, "cannot write bundle '", bundleDir, "': cannot create '", dir,
               "': ", std::strerror(errno));
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
          if (p.shard.split()) {
            b.shape = p.shard.fullShape;
            b.bytes = rt::numElements(b.shape).value_or(0) * int64_t(rt::dtypeSize(b.dtype));
          }
          all.push_back({p, b});
        }
    // Weights past the host's memory end in LLVM's fatal out-of-memory
    // handler (an abort) as soon as they are allocated: refuse them first.
    std::optional<int64_t> weightBytes = 0;
    for (const auto &[p, b] : all)
      weightBytes = weightBytes ? rt::checkedAdd(*weightBytes, b.bytes) : std::nullopt;
    int64_t hostBytes = int64_t(::sysconf(_SC_PHYS_PAGES)) * int64_t(::sysconf(_SC_PAGE_SIZE));
    if (!options.noWeights && (!weightBytes || (hostBytes > 0 && *weightBytes > hostBytes)))
      return emitError(module.getLoc())
             << "the parameters need "
             << (weightBytes ? std::to_string(*weightBytes) : std::string("more than 2^63"))
             << " bytes, more than this machine's " << hostBytes
             << " bytes of memory; compile with --no-weights (the runtime initialises them when "
                "it loads the bundle)";
    storage.reserve(all.size());
    for (const auto &[p, b] : all) {
      if (options.noWeights)
        break;
      storage.emplace_back(static_cast<size_t>(b.bytes));
      char *dst = storage.back().data();
      if (given) {
        auto it = given->tensors.find(p.name);
        if (it == given->tensors.end())
          return emitError(nowhere) << options.weightsFile << ": parameter '" << p.name
                                    << "' is missing";
        if (it->second.dtype != b.dtype || it->second.shape != b.shape)
          return emitError(nowhere)
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
        rt::writeFileAtomically(dir + "/kernels.ptx", ptx->data(), ptx->size());
      }
    }
    if (!options.tokenizerFile.empty()) {
      bool json = llvm::StringRef(options.tokenizerFile).ends_with(".json");
      if (!json && !llvm::StringRef(options.tokenizerFile).ends_with(".model"))
        return emitError(nowhere) << "tokenizer '" << options.tokenizerFile
                                  << "' must be a tokenizer.json or a SentencePiece .model";
      manifest->tokenizer = json ? "tokenizer.json" : "tokenizer.model";
      std::vector<char> bytes = rt::readWholeFile(options.tokenizerFile);
      rt::writeFileAtomically(dir + "/" + manifest->tokenizer, bytes.data(), bytes.size());
    }
    if (options.noWeights) {
      manifest->weights = ""; // the runtime initialises from the seed
      rt::writeManifest(*manifest, dir);
    } else {
      rt::writeManifest(*manifest, dir);
      rt::writeSafetensors(dir + "/" + manifest->weights, refs,
                           {{"model", options.modelName}, {"seed", std::to_string(options.seed)}});
    }
    replaceBundle(dir, bundleDir);
  } catch (const rt::Error &e) {
    return emitError(nowhere) << e.what();
  }
  if (out)
    *out = std::move(*manifest);
  return success();
}
