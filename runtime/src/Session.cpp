//===- Session.cpp - A loaded bundle, ready to run ------------------------===//

#include "runtime/src/Session.h"
#include "loom/rt/Error.h"
#include "loom/rt/Init.h"
#include "loom/rt/Safetensors.h"

#include <cstdlib>
#include <cstring>
#include <unistd.h>
#include <fstream>
#include <iterator>

namespace loom::rt {

Session::Session(const std::string &bundleDir, const SessionOptions &options)
    : dir(bundleDir), backendKind(options.backend) {
  bundle = readManifest(bundleDir);
  if (options.rank < 0 || options.rank >= static_cast<int>(bundle.ranks.size()))
    fail(LOOM_INVALID_ARGUMENT, bundleDir, ": rank ", options.rank, " does not exist (the bundle has ",
         bundle.ranks.size(), ")");
  rankIndex = static_cast<size_t>(options.rank);
  comm = options.comm;
  nccl = options.nccl;
  bool connected = options.backend == "cuda"
                       ? nccl != nullptr || options.aloneForMeasurement
                       : comm && comm->size() == static_cast<int>(bundle.ranks.size());
  if (bundle.ranks.size() > 1 && !connected)
    fail(LOOM_UNSUPPORTED, bundleDir, ": the bundle has ", bundle.ranks.size(),
         " ranks; run it with loom-run, which starts every rank");
  const RankProgram &r = rank();
  // An arena past the host's memory fails to allocate, or is allocated and
  // then ends the process when the kernel runs out of pages: refuse it here.
  int64_t hostBytes = int64_t(::sysconf(_SC_PHYS_PAGES)) * int64_t(::sysconf(_SC_PAGE_SIZE));
  if (options.backend == "cpu" && hostBytes > 0 && r.arenaBytes > hostBytes)
    fail(LOOM_INVALID_ARGUMENT, bundleDir, "/manifest.json: field 'ranks[", rankIndex,
         "].arena_bytes' is ", r.arenaBytes, " bytes, more than this machine's ", hostBytes,
         " bytes of memory");
  if (options.backend == "cpu")
    backend = makeCpuBackend(r, options.threads, comm.get());
  else if (options.backend == "cuda") {
    std::string ptx;
    if (!bundle.kernels.empty()) { // generated kernels the GPU loads
      std::ifstream in(dir + "/" + bundle.kernels, std::ios::binary);
      if (!in)
        fail(LOOM_INVALID_BUNDLE, dir, "/", bundle.kernels, ": missing (the manifest names it)");
      ptx.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    backend = makeCudaBackend(r, options.device, nccl.get(), ptx);
  }
  else
    fail(LOOM_INVALID_ARGUMENT, "unknown backend '", options.backend, "'; use cpu or cuda");
  if (bundle.weights.empty()) {
    // Compiled with --no-weights: initialise from the bundle's seed.
    for (const Parameter &p : r.params) {
      const Buffer &b = r.buffers[p.buffer];
      std::vector<char> host(b.bytes);
      if (p.shard.split()) { // the full tensor, as one device would have it, then this part
        Buffer full = b;
        full.shape = p.shard.fullShape;
        full.bytes = numElements(full.shape).value_or(0) * int64_t(dtypeSize(b.dtype));
        std::vector<char> whole(full.bytes);
        initialiseInto(p.init, full, bundle.seed, p.name, whole.data());
        extractShard(p.shard, dtypeSize(b.dtype), whole.data(), host.data());
      } else {
        initialiseInto(p.init, b, bundle.seed, p.name, host.data());
      }
      backend->upload(b, host.data());
    }
  } else {
    loadWeights(dir + "/" + bundle.weights);
  }
  if (!r.programs.count("forward") && !r.programs.count("step") && !bundle.serve.enabled())
    fail(LOOM_INVALID_BUNDLE, dir, "/manifest.json: rank ", r.rank,
         " has neither a 'forward' nor a 'step' program");
  for (const auto &[name, instrs] : r.programs)
    backend->prepare(name, instrs);
  prepareDue = true;
}

void Session::prepareIfDue() {
  // A serving bundle's engine runs its own "prepare" (ServeConfig::prepare).
  if (prepareDue && !bundle.serve.enabled() && backend->has("prepare"))
    backend->run("prepare");
  prepareDue = false;
}

void Session::gatherParameters() const {
  if (mastersStale && backend->has("gather_parameters"))
    backend->run("gather_parameters");
  mastersStale = false;
}

std::vector<char> Session::read(const Buffer &b) const {
  // Reading one parameter must not start a collective the other ranks do
  // not join: the caller gathers on every rank first.
  if (b.role == BufferRole::Param && mastersStale && backend->has("gather_parameters"))
    fail(LOOM_INVALID_ARGUMENT, "parameter buffer '", b.name, "' is up to date only in slices over the "
         "data-parallel ranks (mixed-precision ZeRO-1); call gatherParameters() on every rank first");
  std::vector<char> out(b.bytes);
  backend->download(b, out.data());
  return out;
}

void Session::write(const Buffer &b, const void *src) {
  // The other masters would be sliced again from stale wholes.
  if (b.role == BufferRole::Param && mastersStale && backend->has("gather_parameters"))
    fail(LOOM_INVALID_ARGUMENT, "parameter buffer '", b.name, "' cannot be written while the masters are "
         "up to date only in slices over the data-parallel ranks (mixed-precision ZeRO-1); call "
         "gatherParameters() on every rank first");
  backend->upload(b, src);
  prepareDue |= b.role == BufferRole::Param;
}

char *Session::data(const Buffer &b) const {
  char *p = backend->hostData(b);
  if (!p)
    fail(LOOM_UNSUPPORTED, "buffer '", b.name, "' lives in ", backendKind,
         " memory; copy it with Session::read");
  return p;
}

void Session::abortPeers(const std::string &message) {
  if (comm)
    comm->abort(static_cast<int>(rank().rank), message);
  if (nccl)
    abortNcclWorld(*nccl, message);
}

bool Session::canTrain() const { return backend->has("backward") || backend->has("step"); }

void Session::runProgram(const std::string &name) {
  if (!backend->has(name))
    fail(LOOM_INVALID_ARGUMENT, "the bundle has no '", name, "' program");
  if (name == "gather_parameters")
    return gatherParameters();
  if (name != "prepare")
    prepareIfDue();
  backend->run(name);
  mastersStale |= name == "update" && backend->has("gather_parameters");
}

float Session::loss() const {
  if (rank().outputs.empty())
    fail(LOOM_INVALID_ARGUMENT, "the bundle has no outputs");
  const Buffer &b = rank().buffers[rank().outputs.front().buffer];
  if (b.dtype != LOOM_F32 || b.bytes != 4)
    fail(LOOM_INVALID_ARGUMENT, "the bundle's first output is not a scalar f32 loss");
  float v;
  backend->download(b, &v);
  return v;
}

float Session::trainStep() {
  if (!canTrain())
    fail(LOOM_INVALID_ARGUMENT, "this bundle was compiled for inference; compile with "
         "loomc compile --train to train");
  prepareIfDue();
  if (backend->has("step")) { // pipelined: the schedule's forward and backward tasks
    backend->run("step");
  } else {
    backend->run("forward");
    backend->run("backward");
  }
  if (backend->has("update")) {
    backend->run("update");
    mastersStale = backend->has("gather_parameters");
  }
  return loss();
}

int64_t Session::step() const {
  for (const NamedBuffer &nb : rank().state)
    if (nb.name == "step") {
      float v;
      backend->download(rank().buffers[nb.buffer], &v);
      return static_cast<int64_t>(v);
    }
  return 0;
}

void Session::saveCheckpoint(const std::string &path) const {
  gatherParameters();
  std::vector<SafetensorsTensorRef> refs;
  std::vector<std::vector<char>> copies;
  copies.reserve(rank().params.size() + rank().state.size());
  for (const Parameter &p : rank().params) {
    const Buffer &b = rank().buffers[p.buffer];
    copies.push_back(read(b));
    refs.push_back({p.name, b.dtype, b.shape, copies.back().data(), static_cast<size_t>(b.bytes)});
  }
  for (const NamedBuffer &nb : rank().state) {
    const Buffer &b = rank().buffers[nb.buffer];
    copies.push_back(read(b));
    refs.push_back({"state." + nb.name, b.dtype, b.shape, copies.back().data(), static_cast<size_t>(b.bytes)});
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
    backend->upload(rank().buffers[p.buffer], file.bytesOf(p.name));
  for (const NamedBuffer &nb : rank().state)
    backend->upload(rank().buffers[nb.buffer], file.bytesOf("state." + nb.name));
  prepareDue = true, mastersStale = false;
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

/// The named input, checked to take exactly `bytes` bytes.
static const Buffer &inputOfSize(const Session &s, const std::string &name, size_t bytes) {
  const Buffer &b = s.input(name);
  if (bytes != static_cast<size_t>(b.bytes))
    fail(LOOM_INVALID_ARGUMENT, "input '", name, "' is ", dtypeName(b.dtype), shapeStr(b.shape),
         " (", b.bytes, " bytes), got ", bytes, " bytes");
  return b;
}

void Session::bindInput(const std::string &name, const void *src, size_t bytes) {
  backend->upload(inputOfSize(*this, name, bytes), src);
}

void Session::bindInputBeforeRun(const std::string &name, const void *src, size_t bytes) {
  backend->uploadBeforeRun(inputOfSize(*this, name, bytes), src);
}

void Session::bindInputFromDevice(const std::string &name, const void *src, size_t bytes, int device) {
  backend->uploadFromDevice(inputOfSize(*this, name, bytes), src, device);
}

char *Session::outputData(const std::string &name) const {
  char *p = backend->arenaData(output(name));
  if (!p)
    fail(LOOM_UNSUPPORTED, "output '", name, "' cannot be read in place on the ", backendKind,
         " backend; copy it with loom_session_read_output");
  return p;
}

void Session::readOutput(const std::string &name, void *dst, size_t bytes) const {
  const Buffer &b = output(name);
  if (bytes != static_cast<size_t>(b.bytes))
    fail(LOOM_INVALID_ARGUMENT, "output '", name, "' is ", dtypeName(b.dtype), shapeStr(b.shape),
         " (", b.bytes, " bytes), got a destination of ", bytes, " bytes");
  backend->download(b, dst);
}

void Session::runForward() {
  if (!backend->has("forward"))
    fail(LOOM_UNSUPPORTED, "this bundle runs forward and backward together in its pipelined "
         "'step' program; train with it (loom-run --steps N) or compile without pipelining");
  prepareIfDue();
  backend->run("forward");
}

void Session::loadWeights(const std::string &path) {
  SafetensorsFile file = readSafetensors(path);
  // Every parameter is checked before any is overwritten, so a bad file
  // leaves the session as it was.
  std::vector<const SafetensorsEntry *> entries;
  for (const Parameter &p : rank().params) {
    const Buffer &b = rank().buffers[p.buffer];
    auto it = file.tensors.find(p.name);
    if (it == file.tensors.end())
      fail(LOOM_INVALID_BUNDLE, path, ": parameter '", p.name, "' is missing");
    const SafetensorsEntry &e = it->second;
    const Shape &want = p.shard.split() ? p.shard.fullShape : b.shape;
    if (e.dtype != b.dtype || e.shape != want)
      fail(LOOM_INVALID_BUNDLE, path, ": parameter '", p.name, "' is ", dtypeName(e.dtype),
           shapeStr(e.shape), " in the file but ", dtypeName(b.dtype), shapeStr(want),
           " in the bundle");
    entries.push_back(&e);
  }
  for (size_t i = 0; i < rank().params.size(); ++i) {
    const Parameter &p = rank().params[i];
    const Buffer &b = rank().buffers[p.buffer];
    const SafetensorsEntry &e = *entries[i];
    if (p.shard.split()) { // weight files hold full tensors; this rank takes its part
      std::vector<char> part(b.bytes);
      extractShard(p.shard, dtypeSize(b.dtype), file.data.data() + e.offset, part.data());
      backend->upload(b, part.data());
    } else {
      backend->upload(b, file.data.data() + e.offset);
    }
  }
  prepareDue = true, mastersStale = false;
}

void Session::saveWeights(const std::string &path) const {
  for (const Parameter &p : rank().params)
    if (p.shard.split())
      fail(LOOM_UNSUPPORTED, "parameter '", p.name, "' is split over ranks; save a checkpoint "
           "per rank (loom-run --checkpoint) or gather the parts with insertShard");
  gatherParameters();
  std::vector<SafetensorsTensorRef> refs;
  std::vector<std::vector<char>> copies;
  copies.reserve(rank().params.size());
  for (const Parameter &p : rank().params) {
    const Buffer &b = rank().buffers[p.buffer];
    copies.push_back(read(b));
    refs.push_back({p.name, b.dtype, b.shape, copies.back().data(), static_cast<size_t>(b.bytes)});
  }
  writeSafetensors(path, refs, {{"model", bundle.model}});
}

} // namespace loom::rt
