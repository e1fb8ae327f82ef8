//===- CApi.cpp - The C API over Session ----------------------------------===//

#include "loom/runtime.h"
#include "runtime/src/CApiStatus.h"
#include "loom/rt/Error.h"
#include "runtime/src/ProcessJob.h"
#include "runtime/src/Session.h"
#include "runtime/src/ThreadPool.h"

#include <new>
#include <string>

struct loom_session_t {
  std::unique_ptr<loom::rt::Session> session;
};

namespace {
using loom::rt::capi::guarded;
using loom::rt::capi::makeStatus;
using loom::rt::capi::nullArgument;

loom_tensor_info_t infoOf(const loom::rt::NamedBuffer &nb, const loom::rt::Buffer &b) {
  loom_tensor_info_t info{};
  info.name = nb.name.c_str();
  info.dtype = b.dtype;
  info.rank = static_cast<int32_t>(b.shape.size());
  for (size_t i = 0; i < b.shape.size() && i < LOOM_MAX_RANK; ++i)
    info.shape[i] = b.shape[i];
  info.bytes = static_cast<size_t>(b.bytes);
  return info;
}
} // namespace

namespace {
/// Runs `work`; if it fails on one rank of a multi-rank bundle, the other
/// ranks are stopped too (they would wait for this one until the timeout).
template <typename Work> void stopPeersOnError(loom::rt::Session &s, Work work) {
  try {
    work();
  } catch (const loom::rt::Error &e) {
    s.abortPeers(e.what());
    throw;
  }
}

} // namespace

extern "C" {

loom_status_code_t loom_status_code(const loom_status_t *status) {
  return status ? status->code : LOOM_OK;
}

const char *loom_status_message(const loom_status_t *status) {
  return status ? status->message.c_str() : "ok";
}

void loom_status_free(loom_status_t *status) { delete status; }

void loom_session_options_init(loom_session_options_t *options) {
  if (options) {
    options->backend = "cpu";
    options->num_threads = 0;
    options->timeout_seconds = loom::rt::kDefaultTimeoutSeconds;
  }
}

loom_status_t *loom_session_create(const char *bundle_path, const loom_session_options_t *options,
                                   loom_session_t **out_session) {
  if (!bundle_path)
    return nullArgument("bundle_path");
  if (!out_session)
    return nullArgument("out_session");
  *out_session = nullptr;
  return guarded([&] {
    loom::rt::SessionOptions opts;
    if (options) {
      if (options->backend)
        opts.backend = options->backend;
      loom::rt::capi::checkNumThreads(options->num_threads);
      opts.threads = options->num_threads;
      loom::rt::checkTimeout(options->timeout_seconds, "options.timeout_seconds");
      opts.timeoutSeconds = options->timeout_seconds;
    }
    // A multi-rank bundle in a job started by mpirun (or Slurm): this process
    // is the rank the launcher gave it, connected to the others over MPI or
    // TCP (and NCCL on GPUs).
    loom::rt::Manifest manifest = loom::rt::readManifest(bundle_path);
    if (manifest.ranks.size() > 1 && loom::rt::launchedAsProcesses())
      loom::rt::joinProcessJob(manifest, bundle_path, opts);
    auto s = std::make_unique<loom_session_t>();
    s->session = std::make_unique<loom::rt::Session>(bundle_path, opts);
    *out_session = s.release();
  });
}

void loom_session_destroy(loom_session_t *session) { delete session; }

int32_t loom_session_rank(const loom_session_t *session) {
  return session ? static_cast<int32_t>(session->session->rank().rank) : -1;
}

int32_t loom_session_num_ranks(const loom_session_t *session) {
  return session ? static_cast<int32_t>(session->session->manifest().ranks.size()) : 0;
}

int32_t loom_session_num_inputs(const loom_session_t *session) {
  return session ? static_cast<int32_t>(session->session->rank().inputs.size()) : 0;
}

int32_t loom_session_num_outputs(const loom_session_t *session) {
  return session ? static_cast<int32_t>(session->session->rank().outputs.size()) : 0;
}

static loom_status_t *tensorInfo(const loom_session_t *session, int32_t index, bool input,
                                 loom_tensor_info_t *out) {
  if (!session)
    return nullArgument("session");
  if (!out)
    return nullArgument("out_info");
  const auto &rank = session->session->rank();
  const auto &list = input ? rank.inputs : rank.outputs;
  if (index < 0 || index >= static_cast<int32_t>(list.size()))
    return makeStatus(LOOM_INVALID_ARGUMENT, "index " + std::to_string(index) +
                                                 " is outside the " + std::to_string(list.size()) +
                                                 (input ? " inputs" : " outputs"));
  *out = infoOf(list[index], rank.buffers[list[index].buffer]);
  return nullptr;
}

loom_status_t *loom_session_input_info(const loom_session_t *session, int32_t index,
                                       loom_tensor_info_t *out_info) {
  return tensorInfo(session, index, true, out_info);
}

loom_status_t *loom_session_output_info(const loom_session_t *session, int32_t index,
                                        loom_tensor_info_t *out_info) {
  return tensorInfo(session, index, false, out_info);
}

loom_status_t *loom_session_bind_input(loom_session_t *session, const char *name,
                                       const void *data, size_t bytes) {
  if (!session || !name || !data)
    return nullArgument("session, name and data");
  return guarded([&] { session->session->bindInput(name, data, bytes); });
}

loom_status_t *loom_session_run_forward(loom_session_t *session) {
  if (!session)
    return nullArgument("session");
  return guarded([&] { stopPeersOnError(*session->session, [&] { session->session->runForward(); }); });
}

loom_status_t *loom_session_read_output(loom_session_t *session, const char *name, void *data,
                                        size_t bytes) {
  if (!session || !name || !data)
    return nullArgument("session, name and data");
  return guarded([&] { session->session->readOutput(name, data, bytes); });
}

loom_status_t *loom_session_train_step(loom_session_t *session, float *out_loss) {
  if (!session)
    return nullArgument("session");
  return guarded([&] {
    float loss = 0;
    stopPeersOnError(*session->session, [&] { loss = session->session->trainStep(); });
    if (out_loss)
      *out_loss = loss;
  });
}

int64_t loom_session_step(const loom_session_t *session) {
  if (!session)
    return 0;
  int64_t step = -1;
  loom_status_free(guarded([&] { step = session->session->step(); }));
  return step;
}

loom_status_t *loom_session_save_checkpoint(loom_session_t *session, const char *path) {
  if (!session || !path)
    return nullArgument("session and path");
  return guarded([&] { session->session->saveCheckpoint(path); });
}

loom_status_t *loom_session_load_checkpoint(loom_session_t *session, const char *path) {
  if (!session || !path)
    return nullArgument("session and path");
  return guarded([&] { session->session->loadCheckpoint(path); });
}

loom_status_t *loom_session_save_weights(loom_session_t *session, const char *path) {
  if (!session || !path)
    return nullArgument("session and path");
  return guarded([&] { session->session->saveWeights(path); });
}

loom_status_t *loom_session_load_weights(loom_session_t *session, const char *path) {
  if (!session || !path)
    return nullArgument("session and path");
  return guarded([&] { session->session->loadWeights(path); });
}

loom_status_t *loom_session_device(const loom_session_t *session, loom_device_t *out_device) {
  if (!session || !out_device)
    return nullArgument("session and out_device");
  int cuda = session->session->cudaDevice();
  *out_device = cuda < 0 ? loom_device_t{LOOM_DEVICE_CPU, 0} : loom_device_t{LOOM_DEVICE_CUDA, cuda};
  return nullptr;
}

loom_status_t *loom_session_output_data(loom_session_t *session, const char *name, void **out_data) {
  if (!session || !name || !out_data)
    return nullArgument("session, name and out_data");
  *out_data = nullptr;
  return guarded([&] { *out_data = session->session->outputData(name); });
}

loom_status_t *loom_session_bind_input_from(loom_session_t *session, const char *name,
                                            const void *data, size_t bytes,
                                            const loom_device_t *device) {
  if (!session || !name || !data)
    return nullArgument("session, name and data");
  if (!device || device->type == LOOM_DEVICE_CPU)
    return loom_session_bind_input(session, name, data, bytes);
  if (device->type != LOOM_DEVICE_CUDA)
    return makeStatus(LOOM_INVALID_ARGUMENT, "device type " + std::to_string(device->type) +
                                                 " is neither LOOM_DEVICE_CPU (1) nor LOOM_DEVICE_CUDA (2)");
  return guarded([&] { session->session->bindInputFromDevice(name, data, bytes, device->id); });
}

} // extern "C"
