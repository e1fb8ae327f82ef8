//===- Session.cpp - A loaded bundle, ready to run ------------------------===//

#include "runtime/src/Session.h"
#include "runtime/src/Error.h"
#include "runtime/src/Safetensors.h"

#include <cstring>

namespace loom::rt {

Session::Session(const std::string &bundleDir, const SessionOptions &options) : dir(bundleDir) {
  bundle = readManifest(bundleDir);
  if (bundle.ranks.size() != 1)
    fail(LOOM_UNSUPPORTED, bundleDir, ": the bundle has ", bundle.ranks.size(),
         " ranks; this runtime runs single-rank bundles (compile with --cluster cpu:1)");
  if (options.backend != "cpu")
    fail(LOOM_UNSUPPORTED, "backend '", options.backend,
         "' is not available in this build; use 'cpu'");
  const RankProgram &r = rank();
  size_t bytes = (static_cast<size_t>(r.arenaBytes) + 63) / 64 * 64;
  arena.reset(static_cast<char *>(std::aligned_alloc(64, std::max<size_t>(bytes, 64))));
  if (!arena)
    fail(LOOM_INVALID_ARGUMENT, "cannot allocate the arena of ", r.arenaBytes,
         " bytes that the bundle asks for");
  std::memset(arena.get(), 0, bytes);
  pool = std::make_unique<ThreadPool>(options.threads);
  loadWeights(dir + "/" + bundle.weights);
  auto it = r.programs.find("forward");
  if (it == r.programs.end())
    fail(LOOM_INVALID_BUNDLE, dir, "/manifest.json: rank 0 has no 'forward' program");
  forward = std::make_unique<CpuProgram>(r, it->second, arena.get(), *pool, "forward");
  if (auto b = r.programs.find("backward"); b != r.programs.end())
    backward = std::make_unique<CpuProgram>(r, b->second, arena.get(), *pool, "backward");
  if (auto u = r.programs.find("update"); u != r.programs.end())
    update = std::make_unique<CpuProgram>(r, u->second, arena.get(), *pool, "update");
}

void Session::runProgram(const std::string &name) {
  CpuProgram *p = name == "forward" ? forward.get() : name == "backward" ? backward.get()
                : name == "update"  ? update.get() : nullptr;
  if (!p)
    fail(LOOM_INVALID_ARGUMENT, "the bundle has no '", name, "' program");
  p->run();
}

float Session::loss() const {
  if (rank().outputs.empty())
    fail(LOOM_INVALID_ARGUMENT, "the bundle has no outputs");
  const Buffer &b = rank().buffers[rank().outputs.front().buffer];
  if (b.dtype != LOOM_F32 || b.bytes != 4)
    fail(LOOM_INVALID_ARGUMENT, "the bundle's first output is not a scalar f32 loss");
  float v;
  std::memcpy(&v, data(b), 4);
  return v;
}

float Session::trainStep() {
  if (!backward)
    fail(LOOM_INVALID_ARGUMENT, "this bundle was compiled for inference; compile with "
         "loomc compile --train to train");
  forward->run();
  backward->run();
  if (update)
    update->run();
  return loss();
}

int64_t Session::step() const {
  for (const NamedBuffer &nb : rank().state)
    if (nb.name == "step") {
      float v;
      std::memcpy(&v, data(rank().buffers[nb.buffer]), 4);
      return static_cast<int64_t>(v);
    }
  return 0;
}

void Session::saveCheckpoint(const std::string &path) const {
  std::vector<SafetensorsTensorRef> refs;
  for (const Parameter &p : rank().params) {
    const Buffer &b = rank().buffers[p.buffer];
    refs.push_back({p.name, b.dtype, b.shape, data(b), static_cast<size_t>(b.bytes)});
  }
  for (const NamedBuffer &nb : rank().state) {
    const Buffer &b = rank().buffers[nb.buffer];
    refs.push_back({"state." + nb.name, b.dtype, b.shape, data(b), static_cast<size_t>(b.bytes)});
  }
  writeSafetensors(path, refs, {{"model", bundle.model}, {"step", std::to_string(step())}});
}

void Session::loadCheckpoint(const std::string &path) {
  SafetensorsFile file = readSafetensors(path);
  auto copyIn = [&](const std::string &name, const Buffer &b) {
    auto it = file.tensors.find(name);
    if (it == file.tensors.end())
      fail(LOOM_INVALID_ARGUMENT, path, ": checkpoint has no tensor '", name,
           "' (was it written by a different model or optimizer?)");
    if (it->second.dtype != b.dtype || it->second.shape != b.shape)
      fail(LOOM_INVALID_ARGUMENT, path, ": '", name, "' is ", dtypeName(it->second.dtype),
           shapeStr(it->second.shape), " in the checkpoint but ", dtypeName(b.dtype),
           shapeStr(b.shape), " in the bundle");
  };
  // Validate everything before touching the session, so a bad file changes nothing.
  for (const Parameter &p : rank().params)
    copyIn(p.name, rank().buffers[p.buffer]);
  for (const NamedBuffer &nb : rank().state)
    copyIn("state." + nb.name, rank().buffers[nb.buffer]);
  for (const Parameter &p : rank().params)
    std::memcpy(data(rank().buffers[p.buffer]), file.bytesOf(p.name), rank().buffers[p.buffer].bytes);
  for (const NamedBuffer &nb : rank().state)
    std::memcpy(data(rank().buffers[nb.buffer]), file.bytesOf("state." + nb.name),
                rank().buffers[nb.buffer].bytes);
}

static const Buffer &findNamed(const RankProgram &r, const std::vector<NamedBuffer> &list,
                               const std::string &name, const char *kind) {
  for (const NamedBuffer &nb : list)
    if (nb.name == name)
      return r.buffers[nb.buffer];
  std::string known;
  for (const NamedBuffer &nb : list)
    known += (known.empty() ? "" : ", ") + nb.name;
  fail(LOOM_INVALID_ARGUMENT, "no ", kind, " named '", name, "'; the bundle has: ", known);
}

const Buffer &Session::input(const std::string &name) const {
  return findNamed(rank(), rank().inputs, name, "input");
}

const Buffer &Session::output(const std::string &name) const {
  return findNamed(rank(), rank().outputs, name, "output");
}

void Session::bindInput(const std::string &name, const void *src, size_t bytes) {
  const Buffer &b = input(name);
  if (bytes != static_cast<size_t>(b.bytes))
    fail(LOOM_INVALID_ARGUMENT, "input '", name, "' is ", dtypeName(b.dtype), shapeStr(b.shape),
         " (", b.bytes, " bytes), got ", bytes, " bytes");
  std::memcpy(data(b), src, bytes);
}

void Session::readOutput(const std::string &name, void *dst, size_t bytes) const {
  const Buffer &b = output(name);
  if (bytes != static_cast<size_t>(b.bytes))
    fail(LOOM_INVALID_ARGUMENT, "output '", name, "' is ", dtypeName(b.dtype), shapeStr(b.shape),
         " (", b.bytes, " bytes), got a destination of ", bytes, " bytes");
  std::memcpy(dst, data(b), bytes);
}

void Session::runForward() { forward->run(); }

void Session::loadWeights(const std::string &path) {
  SafetensorsFile file = readSafetensors(path);
  for (const Parameter &p : rank().params) {
    const Buffer &b = rank().buffers[p.buffer];
    auto it = file.tensors.find(p.name);
    if (it == file.tensors.end())
      fail(LOOM_INVALID_BUNDLE, path, ": parameter '", p.name, "' is missing");
    const SafetensorsEntry &e = it->second;
    if (e.dtype != b.dtype || e.shape != b.shape)
      fail(LOOM_INVALID_BUNDLE, path, ": parameter '", p.name, "' is ", dtypeName(e.dtype),
           shapeStr(e.shape), " in the file but ", dtypeName(b.dtype), shapeStr(b.shape),
           " in the bundle");
    std::memcpy(data(b), file.data.data() + e.offset, e.bytes);
  }
}

void Session::saveWeights(const std::string &path) const {
  std::vector<SafetensorsTensorRef> refs;
  for (const Parameter &p : rank().params) {
    const Buffer &b = rank().buffers[p.buffer];
    refs.push_back({p.name, b.dtype, b.shape, data(b), static_cast<size_t>(b.bytes)});
  }
  writeSafetensors(path, refs, {{"model", bundle.model}});
}

} // namespace loom::rt
