//===- NativeModule.cpp - loom._native: the runtime's C API for Python ----===//
//
// A thin layer over runtime/include/loom/runtime.h: every call goes through
// the public C API, whose status becomes loom.LoomError. Arrays cross as
// nanobind ndarrays (NumPy's buffer protocol or DLPack); the Python side
// (loom/session.py) adds keyword inputs and the DLPack stream handshake.
// Serving (loom/server.py): a server, its tokenizer, and generations whose
// tokens the server's thread queues and Python threads wait for without
// the GIL.
//
//===----------------------------------------------------------------------===//

#include "loom/runtime.h"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <vector>

namespace nb = nanobind;

namespace {

/// A failed C API call, raised in Python as loom.LoomError(message, code).
struct StatusError {
  loom_status_code_t code;
  std::string message;
};

const char *codeName(loom_status_code_t code) {
  switch (code) {
  case LOOM_OK: return "ok";
  case LOOM_INVALID_ARGUMENT: return "invalid_argument";
  case LOOM_INVALID_BUNDLE: return "invalid_bundle";
  case LOOM_UNSUPPORTED: return "unsupported";
  case LOOM_IO_ERROR: return "io_error";
  case LOOM_INTERNAL: return "internal";
  case LOOM_RESOURCE_EXHAUSTED: return "resource_exhausted";
  }
  return "internal";
}

void check(loom_status_t *status) {
  if (!status)
    return;
  StatusError e{loom_status_code(status), loom_status_message(status)};
  loom_status_free(status);
  throw e;
}

/// The runtime's dtypes with their NumPy/PyTorch names and DLPack codes.
struct DtypeName {
  loom_dtype_t dtype;
  const char *name;
  nb::dlpack::dtype dl;
};
const DtypeName kDtypes[] = {
    {LOOM_F32, "float32", nb::dtype<float>()},
    {LOOM_F64, "float64", nb::dtype<double>()},
    {LOOM_BF16, "bfloat16", {uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1}},
    {LOOM_F16, "float16", {uint8_t(nb::dlpack::dtype_code::Float), 16, 1}},
    {LOOM_I32, "int32", nb::dtype<int32_t>()},
    {LOOM_I64, "int64", nb::dtype<int64_t>()},
};

const DtypeName &dtypeOf(loom_dtype_t dtype) {
  for (const DtypeName &d : kDtypes)
    if (d.dtype == dtype)
      return d;
  throw StatusError{LOOM_INTERNAL, "the runtime reported dtype " + std::to_string(dtype) +
                                       ", which these bindings do not know"};
}

const DtypeName &dtypeNamed(const std::string &name) {
  for (const DtypeName &d : kDtypes)
    if (name == d.name)
      return d;
  throw StatusError{LOOM_INTERNAL, "no dtype named '" + name + "'"};
}

/// "int64", "uint8", "bool", ... for an array's DLPack dtype.
std::string dlpackName(nb::dlpack::dtype dl) {
  for (const DtypeName &d : kDtypes)
    if (d.dl == dl)
      return d.name;
  const char *kind = "?";
  switch (nb::dlpack::dtype_code(dl.code)) {
  case nb::dlpack::dtype_code::Int: kind = "int"; break;
  case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
  case nb::dlpack::dtype_code::Float: kind = "float"; break;
  case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
  case nb::dlpack::dtype_code::Complex: kind = "complex"; break;
  case nb::dlpack::dtype_code::Bool: return "bool";
  default: break;
  }
  return kind + std::to_string(dl.bits) + (dl.lanes > 1 ? "x" + std::to_string(dl.lanes) : "");
}

std::string shapeText(const std::vector<int64_t> &shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

/// A tensor of the bundle: name, dtype name, shape, bytes.
using Info = std::tuple<std::string, std::string, std::vector<int64_t>, size_t>;

/// An open session. Views of its outputs hold a reference, so the runtime's
/// memory stays alive until the last view is gone, even after close().
struct Handle {
  loom_session_t *session = nullptr;
  std::mutex mutex; // runs release the GIL: one call at a time per session
  Handle() = default;
  Handle(const Handle &) = delete;
  Handle &operator=(const Handle &) = delete;
  ~Handle() { loom_session_destroy(session); }
};

/// A capsule that keeps `handle` alive: the owner of a view's memory.
nb::capsule ownerOf(const std::shared_ptr<Handle> &handle) {
  auto *ref = new std::shared_ptr<Handle>(handle);
  return nb::capsule(ref, [](void *p) noexcept { delete static_cast<std::shared_ptr<Handle> *>(p); });
}

class NativeSession {
public:
  NativeSession(const std::string &bundle, const std::string &backend, int threads, double timeout) {
    loom_session_options_t options;
    loom_session_options_init(&options);
    options.backend = backend.c_str();
    options.num_threads = threads;
    options.timeout_seconds = timeout;
    auto handle = std::make_shared<Handle>();
    {
      nb::gil_scoped_release release; // loads weights and prepares programs
      check(loom_session_create(bundle.c_str(), &options, &handle->session));
    }
    h = std::move(handle);
    for (int32_t i = 0, n = loom_session_num_inputs(h->session); i < n; ++i)
      inputInfos.push_back(infoAt(i, true));
    for (int32_t i = 0, n = loom_session_num_outputs(h->session); i < n; ++i)
      outputInfos.push_back(infoAt(i, false));
  }

  void close() { h.reset(); }
  bool closed() const { return !h; }
  const std::vector<Info> &inputs() const { return inputInfos; }
  const std::vector<Info> &outputs() const { return outputInfos; }

  std::tuple<std::string, int> device() {
    loom_device_t d;
    check(loom_session_device(open()->session, &d));
    return {d.type == LOOM_DEVICE_CUDA ? "cuda" : "cpu", d.id};
  }
  int rank() { return loom_session_rank(open()->session); }
  int numRanks() { return loom_session_num_ranks(open()->session); }
  int64_t step() {
    auto handle = open();
    std::lock_guard<std::mutex> lock(handle->mutex);
    return loom_session_step(handle->session);
  }

  void bind(const std::string &name, nb::handle value) {
    auto handle = open();
    const Info &info = find(inputInfos, name, "input");
    nb::ndarray<nb::ro> array;
    if (!nb::try_cast(value, array, /*convert=*/false))
      throw nb::type_error(("input '" + name + "' must be a NumPy array or a DLPack tensor (PyTorch, "
                            "JAX, CuPy, ...), got " + nb::type_name(value.type()).c_str())
                               .c_str());
    const auto &[_, dtypeName, shape, bytes] = info;
    std::string expected = "input '" + name + "' is " + dtypeName + " of shape " + shapeText(shape);
    if (dlpackName(array.dtype()) != dtypeName)
      throw nb::type_error((expected + ", got " + dlpackName(array.dtype()) +
                            " (convert it first: .astype(numpy." + dtypeName + ") or .to(torch." +
                            dtypeName + "))").c_str());
    std::vector<int64_t> got(array.ndim());
    for (size_t i = 0; i < array.ndim(); ++i)
      got[i] = static_cast<int64_t>(array.shape(i));
    if (got != shape)
      throw nb::value_error((expected + ", got shape " + shapeText(got)).c_str());
    if (!contiguous(array))
      throw nb::value_error((expected + "; the array given is not contiguous (use "
                             "numpy.ascontiguousarray or .contiguous() first)").c_str());
    loom_device_t device{LOOM_DEVICE_CPU, 0};
    switch (array.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value: // pinned host memory
      break;
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      device = {LOOM_DEVICE_CUDA, array.device_id()};
      break;
    default:
      throw nb::value_error(("input '" + name + "' lives on DLPack device type " +
                             std::to_string(array.device_type()) +
                             "; the runtime reads host and CUDA memory only")
                                .c_str());
    }
    std::lock_guard<std::mutex> lock(handle->mutex);
    nb::gil_scoped_release release;
    check(loom_session_bind_input_from(handle->session, name.c_str(), array.data(), bytes, &device));
  }

  void forward() {
    auto handle = open();
    std::lock_guard<std::mutex> lock(handle->mutex);
    nb::gil_scoped_release release;
    check(loom_session_run_forward(handle->session));
  }

  float trainStep() {
    auto handle = open();
    std::lock_guard<std::mutex> lock(handle->mutex);
    nb::gil_scoped_release release;
    float loss = 0;
    check(loom_session_train_step(handle->session, &loss));
    return loss;
  }

  /// A NumPy copy of an output (bf16 widened to f32, which NumPy has).
  nb::ndarray<nb::numpy> output(const std::string &name) {
    auto handle = open();
    const auto &[_, dtypeName, shape, bytes] = find(outputInfos, name, "output");
    const DtypeName &dtype = dtypeNamed(dtypeName);
    std::vector<size_t> dims(shape.begin(), shape.end());
    bool widen = dtype.dtype == LOOM_BF16;
    size_t hostBytes = widen ? bytes * 2 : bytes;
    std::unique_ptr<char[]> data(new char[hostBytes ? hostBytes : 1]);
    {
      std::lock_guard<std::mutex> lock(handle->mutex);
      nb::gil_scoped_release release;
      check(loom_session_read_output(handle->session, name.c_str(), data.get(), bytes));
    }
    if (widen) { // in place, from the back: element i's two bytes become four
      size_t n = bytes / 2;
      for (size_t i = n; i-- > 0;) {
        uint16_t bits;
        std::memcpy(&bits, data.get() + 2 * i, 2);
        uint32_t wide = uint32_t(bits) << 16;
        std::memcpy(data.get() + 4 * i, &wide, 4);
      }
    }
    nb::capsule owner(data.get(), [](void *p) noexcept { delete[] static_cast<char *>(p); });
    return nb::ndarray<nb::numpy>(data.release(), dims.size(), dims.data(), owner, nullptr,
                                  widen ? nb::dtype<float>() : dtype.dl);
  }

  /// A view of an output in the runtime's memory (host or GPU), no copy.
  nb::ndarray<nb::array_api> outputView(const std::string &name) {
    auto handle = open();
    const auto &[_, dtypeName, shape, bytes] = find(outputInfos, name, "output");
    void *data = nullptr;
    loom_device_t device;
    check(loom_session_output_data(handle->session, name.c_str(), &data));
    check(loom_session_device(handle->session, &device));
    std::vector<size_t> dims(shape.begin(), shape.end());
    return nb::ndarray<nb::array_api>(data, dims.size(), dims.data(), ownerOf(handle), nullptr,
                                      dtypeNamed(dtypeName).dl, int(device.type), device.id);
  }

  uintptr_t outputAddress(const std::string &name) {
    find(outputInfos, name, "output");
    void *data = nullptr;
    check(loom_session_output_data(open()->session, name.c_str(), &data));
    return reinterpret_cast<uintptr_t>(data);
  }

  void saveCheckpoint(const std::string &path) { withPath(path, loom_session_save_checkpoint); }
  void loadCheckpoint(const std::string &path) { withPath(path, loom_session_load_checkpoint); }
  void saveWeights(const std::string &path) { withPath(path, loom_session_save_weights); }
  void loadWeights(const std::string &path) { withPath(path, loom_session_load_weights); }

private:
  std::shared_ptr<Handle> open() const {
    if (!h)
      throw StatusError{LOOM_INVALID_ARGUMENT, "the session is closed"};
    return h;
  }

  Info infoAt(int32_t index, bool input) {
    loom_tensor_info_t info;
    check(input ? loom_session_input_info(h->session, index, &info)
                : loom_session_output_info(h->session, index, &info));
    return {info.name, dtypeOf(info.dtype).name,
            std::vector<int64_t>(info.shape, info.shape + info.rank), info.bytes};
  }

  static const Info &find(const std::vector<Info> &list, const std::string &name, const char *kind) {
    for (const Info &info : list)
      if (std::get<0>(info) == name)
        return info;
    std::string known;
    for (const Info &info : list)
      known += (known.empty() ? "" : ", ") + std::get<0>(info);
    throw StatusError{LOOM_INVALID_ARGUMENT, std::string("no ") + kind + " named '" + name +
                                                 "'; the bundle has: " + known};
  }

  static bool contiguous(const nb::ndarray<nb::ro> &array) {
    if (!array.stride_ptr())
      return true;
    int64_t expected = 1;
    for (size_t i = array.ndim(); i-- > 0;) {
      if (array.shape(i) != 1 && array.stride(i) != expected)
        return false;
      expected *= static_cast<int64_t>(array.shape(i));
    }
    return true;
  }

  void withPath(const std::string &path, loom_status_t *(*call)(loom_session_t *, const char *)) {
    auto handle = open();
    std::lock_guard<std::mutex> lock(handle->mutex);
    nb::gil_scoped_release release;
    check(call(handle->session, path.c_str()));
  }

  std::shared_ptr<Handle> h;
  std::vector<Info> inputInfos, outputInfos;
};


//===----------------------------------------------------------------------===//
// Serving
//===----------------------------------------------------------------------===//

/// A Python str of UTF-8 bytes; a byte that is no UTF-8 becomes U+FFFD.
nb::str utf8(const char *data, size_t bytes) {
  PyObject *text = PyUnicode_DecodeUTF8(data, Py_ssize_t(bytes), "replace");
  if (!text)
    throw nb::python_error();
  return nb::steal<nb::str>(text);
}

/// An open server, shared by the Python server and its generations and
/// tokenizer. Every call holds `mutex` shared; close() holds it alone, so
/// nothing uses the server or its tokenizer while it is destroyed. Lock it
/// with the GIL released: destroying waits for the server's thread.
struct ServerHandle {
  loom_server_t *server = nullptr;
  std::shared_mutex mutex;
  ServerHandle() = default;
  ServerHandle(const ServerHandle &) = delete;
  ServerHandle &operator=(const ServerHandle &) = delete;
  ~ServerHandle() { loom_server_destroy(server); }

  void close() {
    std::unique_lock<std::shared_mutex> lock(mutex);
    loom_server_destroy(server);
    server = nullptr;
  }
  /// `mutex` held shared, taken without the GIL (close() holds it alone
  /// while it waits for the server's thread).
  std::shared_lock<std::shared_mutex> sharedLock() {
    nb::gil_scoped_release release;
    return std::shared_lock<std::shared_mutex>(mutex);
  }
  /// The server, for a caller that holds `mutex` shared.
  loom_server_t *open() const {
    if (!server)
      throw StatusError{LOOM_INVALID_ARGUMENT, "the server is closed"};
    return server;
  }
};

/// A request's tokens as the server's thread delivers them, waiting for a
/// Python thread to take them.
struct TokenQueue {
  std::mutex mutex;
  std::condition_variable ready;
  std::deque<int32_t> tokens;
  loom_finish_reason_t finish = LOOM_FINISH_NONE;
  std::string error;

  /// loom_token_callback_t: `user` is a std::shared_ptr<TokenQueue> on the
  /// heap, the server's reference, dropped with the request's last event.
  static void onToken(const loom_token_event_t *event, void *user) {
    auto *ref = static_cast<std::shared_ptr<TokenQueue> *>(user);
    TokenQueue &q = **ref;
    {
      std::lock_guard<std::mutex> lock(q.mutex);
      if (event->token >= 0)
        q.tokens.push_back(event->token);
      if (event->finish != LOOM_FINISH_NONE) {
        q.finish = event->finish;
        if (event->error)
          q.error = event->error;
      }
    }
    q.ready.notify_all();
    if (event->finish != LOOM_FINISH_NONE)
      delete ref;
  }
};

const char *finishName(loom_finish_reason_t finish) {
  switch (finish) {
  case LOOM_FINISH_NONE: return "";
  case LOOM_FINISH_LENGTH: return "length";
  case LOOM_FINISH_STOP: return "stop";
  case LOOM_FINISH_CANCELLED: return "cancelled";
  case LOOM_FINISH_ERROR: return "error";
  }
  return "error";
}

/// One submitted request: its tokens one at a time; cancelled when closed
/// or collected before it finished.
class NativeGeneration {
public:
  NativeGeneration(std::shared_ptr<ServerHandle> server, std::shared_ptr<TokenQueue> queue, uint64_t request)
      : server(std::move(server)), queue(std::move(queue)), id(request) {}
  NativeGeneration(const NativeGeneration &) = delete;
  NativeGeneration &operator=(const NativeGeneration &) = delete;
  ~NativeGeneration() { cancel(); }

  uint64_t request() const { return id; }

  /// The next token, or None once the request ended (raises on an error).
  /// Waits without the GIL, looking for Ctrl-C every 100 ms.
  std::optional<int32_t> next() {
    for (;;) {
      {
        nb::gil_scoped_release release;
        std::unique_lock<std::mutex> lock(queue->mutex);
        auto ready = [&] { return !queue->tokens.empty() || queue->finish != LOOM_FINISH_NONE; };
        if (queue->ready.wait_for(lock, std::chrono::milliseconds(100), ready)) {
          if (!queue->tokens.empty()) {
            int32_t token = queue->tokens.front();
            queue->tokens.pop_front();
            return token;
          }
          if (queue->finish == LOOM_FINISH_ERROR)
            throw StatusError{LOOM_INTERNAL, queue->error};
          return std::nullopt;
        }
      }
      if (PyErr_CheckSignals() != 0)
        throw nb::python_error();
    }
  }

  /// "" while tokens may follow, else "length", "stop", "cancelled" or "error".
  std::string finishReason() {
    std::lock_guard<std::mutex> lock(queue->mutex);
    return finishName(queue->finish);
  }

  /// Ends the request early, unless it ended; the server then stops
  /// producing its tokens and frees its cache.
  void cancel() {
    {
      std::lock_guard<std::mutex> lock(queue->mutex);
      if (queue->finish != LOOM_FINISH_NONE)
        return;
    }
    auto lock = server->sharedLock();
    if (server->server)
      loom_status_free(loom_server_cancel(server->server, id)); // fails only for a NULL server
  }

private:
  std::shared_ptr<ServerHandle> server;
  std::shared_ptr<TokenQueue> queue;
  uint64_t id;
};

/// A tokenizer: opened from a file or bundle (owned), or a server's
/// (borrowed, usable while the server is open).
class NativeTokenizer {
public:
  explicit NativeTokenizer(const std::string &path) {
    loom_tokenizer_t *t = nullptr;
    {
      nb::gil_scoped_release release;
      check(loom_tokenizer_create(path.c_str(), &t));
    }
    owned.reset(t);
    tokenizer = t;
  }
  NativeTokenizer(std::shared_ptr<ServerHandle> server, const loom_tokenizer_t *tokenizer)
      : server(std::move(server)), tokenizer(tokenizer) {}

  /// Runs `call` while the tokenizer is alive: a server's only while the
  /// server is open.
  template <typename F> auto use(F call) {
    if (!server)
      return call();
    auto lock = server->sharedLock();
    server->open();
    return call();
  }

  int32_t vocabSize() { return use([&] { return loom_tokenizer_vocab_size(tokenizer); }); }
  std::optional<int32_t> bosId() { return idOrNone(use([&] { return loom_tokenizer_bos_id(tokenizer); })); }
  std::optional<int32_t> eosId() { return idOrNone(use([&] { return loom_tokenizer_eos_id(tokenizer); })); }
  bool prependsBos() { return use([&] { return loom_tokenizer_prepends_bos(tokenizer) != 0; }); }

  std::vector<int32_t> encode(const std::string &text) {
    std::vector<int32_t> ids(text.size() + 16);
    use([&] {
      nb::gil_scoped_release release;
      size_t n = 0;
      check(loom_tokenizer_encode(tokenizer, text.data(), text.size(), ids.data(), ids.size(), &n));
      if (n > ids.size()) {
        ids.resize(n);
        check(loom_tokenizer_encode(tokenizer, text.data(), text.size(), ids.data(), ids.size(), &n));
      }
      ids.resize(n);
      return 0;
    });
    return ids;
  }

  nb::str decode(const std::vector<int32_t> &ids) {
    std::string text(ids.size() * 4, '\0');
    use([&] {
      nb::gil_scoped_release release;
      size_t n = 0;
      check(loom_tokenizer_decode(tokenizer, ids.data(), ids.size(), text.data(), text.size(), &n));
      if (n > text.size()) {
        text.resize(n);
        check(loom_tokenizer_decode(tokenizer, ids.data(), ids.size(), text.data(), text.size(), &n));
      }
      text.resize(n);
      return 0;
    });
    return utf8(text.data(), text.size());
  }

  const loom_tokenizer_t *get() const { return tokenizer; }
  const std::shared_ptr<ServerHandle> &owner() const { return server; }

private:
  static std::optional<int32_t> idOrNone(int32_t id) { return id >= 0 ? std::optional<int32_t>(id) : std::nullopt; }

  std::shared_ptr<ServerHandle> server;
  std::unique_ptr<loom_tokenizer_t, void (*)(loom_tokenizer_t *)> owned{nullptr, loom_tokenizer_destroy};
  const loom_tokenizer_t *tokenizer = nullptr;
};

/// Decodes a generation's text token by token (loom_token_decoder_*).
class NativeTokenDecoder {
public:
  explicit NativeTokenDecoder(std::shared_ptr<NativeTokenizer> tokenizer) : tokenizer(std::move(tokenizer)) {
    loom_token_decoder_t *d = nullptr;
    this->tokenizer->use([&] {
      check(loom_token_decoder_create(this->tokenizer->get(), &d));
      return 0;
    });
    decoder.reset(d);
  }

  /// The text `token` completes ("" while a character is unfinished).
  nb::str push(int32_t token) {
    return piece([&](const char **text, size_t *n) { return loom_token_decoder_push(decoder.get(), token, text, n); });
  }
  /// What is still held back, at the end.
  nb::str finish() {
    return piece([&](const char **text, size_t *n) { return loom_token_decoder_finish(decoder.get(), text, n); });
  }

private:
  template <typename F> nb::str piece(F call) {
    const char *text = nullptr;
    size_t n = 0;
    tokenizer->use([&] {
      check(call(&text, &n));
      return 0;
    });
    return utf8(text, n);
  }

  std::shared_ptr<NativeTokenizer> tokenizer; // a decoder reads its tokenizer
  std::unique_ptr<loom_token_decoder_t, void (*)(loom_token_decoder_t *)> decoder{nullptr,
                                                                                    loom_token_decoder_destroy};
};

using Prompt = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

class NativeServer {
public:
  NativeServer(const std::string &bundle, const std::string &backend, int threads, int maxQueue) {
    loom_server_options_t options;
    loom_server_options_init(&options);
    options.backend = backend.c_str();
    options.num_threads = threads;
    options.max_queue = maxQueue;
    auto handle = std::make_shared<ServerHandle>();
    {
      nb::gil_scoped_release release; // loads weights, prepares programs, starts the thread
      check(loom_server_create(bundle.c_str(), &options, &handle->server));
    }
    h = std::move(handle);
  }

  void close() {
    nb::gil_scoped_release release; // waits for the server's thread
    h->close();
  }
  bool closed() {
    auto lock = h->sharedLock();
    return !h->server;
  }

  std::unique_ptr<NativeGeneration> submit(Prompt prompt, int maxNewTokens, float temperature, int topK, float topP,
                                           float repetitionPenalty, uint64_t seed,
                                           const std::vector<int32_t> &stopTokens) {
    loom_sampling_params_t params;
    loom_sampling_params_init(&params);
    params.max_new_tokens = maxNewTokens;
    params.temperature = temperature;
    params.top_k = topK;
    params.top_p = topP;
    params.repetition_penalty = repetitionPenalty;
    params.seed = seed;
    params.stop_tokens = stopTokens.data();
    params.num_stop_tokens = int32_t(stopTokens.size());
    auto queue = std::make_shared<TokenQueue>();
    auto *serverRef = new std::shared_ptr<TokenQueue>(queue); // the callback's, until the last event
    uint64_t id = 0;
    loom_status_t *status = nullptr;
    {
      auto lock = h->sharedLock();
      loom_server_t *server = nullptr;
      try {
        server = h->open();
      } catch (...) {
        delete serverRef;
        throw;
      }
      nb::gil_scoped_release release;
      status = loom_server_submit(server, prompt.data(), prompt.shape(0), &params, &TokenQueue::onToken, serverRef,
                                  &id);
    }
    if (status)
      delete serverRef; // refused: the callback never runs
    check(status);
    return std::make_unique<NativeGeneration>(h, std::move(queue), id);
  }

  /// The bundle's tokenizer, or None.
  std::shared_ptr<NativeTokenizer> tokenizer() {
    const loom_tokenizer_t *t = nullptr;
    {
      auto lock = h->sharedLock();
      loom_server_t *server = h->open();
      nb::gil_scoped_release release; // reads it the first time
      check(loom_server_tokenizer(server, &t));
    }
    if (!t)
      return nullptr;
    return std::make_shared<NativeTokenizer>(h, t);
  }

  void drain() {
    auto lock = h->sharedLock();
    loom_server_t *server = h->open();
    nb::gil_scoped_release release;
    check(loom_server_drain(server));
  }

  nb::dict stats() {
    loom_server_stats_t s;
    loom_server_stats_init(&s);
    {
      auto lock = h->sharedLock();
      check(loom_server_stats(h->open(), &s));
    }
    nb::dict d;
    d["submitted"] = s.submitted, d["finished"] = s.finished, d["refused"] = s.refused;
    d["cancelled"] = s.cancelled, d["prompt_tokens"] = s.prompt_tokens;
    d["generated_tokens"] = s.generated_tokens, d["steps"] = s.steps, d["waiting"] = s.waiting;
    d["running"] = s.running, d["free_blocks"] = s.free_blocks, d["total_blocks"] = s.total_blocks;
    return d;
  }

private:
  std::shared_ptr<ServerHandle> h;
};

} // namespace

NB_MODULE(_native, m) {
  m.doc() = "The Loom runtime's C API (runtime/include/loom/runtime.h); use the loom package.";
  nb::register_exception_translator([](const std::exception_ptr &p, void *) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError &e) {
      nb::object error = nb::module_::import_("loom._errors").attr("LoomError");
      PyErr_SetObject(error.ptr(), nb::make_tuple(e.message, codeName(e.code)).ptr());
    }
  });

  nb::class_<NativeSession>(m, "Session", "An open bundle (see loom.Session).")
      .def(nb::init<const std::string &, const std::string &, int, double>(), nb::arg("bundle"),
           nb::arg("backend"), nb::arg("threads"), nb::arg("timeout"),
           "Opens a bundle: loom_session_create.")
      .def("close", &NativeSession::close, "Releases the session (views keep its memory).")
      .def_prop_ro("closed", &NativeSession::closed, "Whether close() was called.")
      .def_prop_ro("inputs", &NativeSession::inputs,
                   "(name, dtype, shape, nbytes) of each input, in the bundle's order.")
      .def_prop_ro("outputs", &NativeSession::outputs,
                   "(name, dtype, shape, nbytes) of each output, in the bundle's order.")
      .def_prop_ro("device", &NativeSession::device, "('cpu', 0) or ('cuda', ordinal).")
      .def_prop_ro("rank", &NativeSession::rank, "This session's rank in its bundle.")
      .def_prop_ro("num_ranks", &NativeSession::numRanks, "The bundle's rank count.")
      .def_prop_ro("step", &NativeSession::step, "Optimizer steps taken so far.")
      .def("bind", &NativeSession::bind, nb::arg("name"), nb::arg("array").none(),
           "Copies an array (host or this session's GPU) into the named input.")
      .def("forward", &NativeSession::forward, "Runs the forward pass.")
      .def("train_step", &NativeSession::trainStep, "One training step; returns the loss.")
      .def("output", &NativeSession::output, nb::arg("name"), "A NumPy copy of an output.")
      .def("output_view", &NativeSession::outputView, nb::arg("name"),
           "A DLPack view of an output in the runtime's memory.")
      .def("output_address", &NativeSession::outputAddress, nb::arg("name"),
           "The address of an output in the runtime's memory.")
      .def("save_checkpoint", &NativeSession::saveCheckpoint, nb::arg("path"),
           "Parameters, optimizer state and step to a safetensors file.")
      .def("load_checkpoint", &NativeSession::loadCheckpoint, nb::arg("path"),
           "Restores a checkpoint; a bad file changes nothing.")
      .def("save_weights", &NativeSession::saveWeights, nb::arg("path"),
           "Parameters to a safetensors file.")
      .def("load_weights", &NativeSession::loadWeights, nb::arg("path"),
           "Parameters from a safetensors file; a bad file changes nothing.");

  nb::class_<NativeGeneration>(m, "Generation", "A submitted request (see loom.Generation).")
      .def_prop_ro("request", &NativeGeneration::request, "The server's id of the request.")
      .def("next", &NativeGeneration::next,
           "The next token, waiting for it without the GIL; None once the request ended.")
      .def_prop_ro("finish_reason", &NativeGeneration::finishReason,
                   "'' while tokens may follow, else 'length', 'stop', 'cancelled' or 'error'.")
      .def("cancel", &NativeGeneration::cancel, "Ends the request early: loom_server_cancel.");

  nb::class_<NativeTokenizer>(m, "Tokenizer", "A bundle's tokenizer (see loom.Tokenizer).")
      .def(nb::init<const std::string &>(), nb::arg("path"),
           "Opens a bundle's tokenizer or a tokenizer file: loom_tokenizer_create.")
      .def_prop_ro("vocab_size", &NativeTokenizer::vocabSize, "One more than the largest id.")
      .def_prop_ro("bos_id", &NativeTokenizer::bosId, "The begin-of-sequence id, or None.")
      .def_prop_ro("prepends_bos", &NativeTokenizer::prependsBos,
                   "Whether a text prompt starts with BOS (SentencePiece, as Llama).")
      .def_prop_ro("eos_id", &NativeTokenizer::eosId, "The end-of-sequence id, or None.")
      .def("encode", &NativeTokenizer::encode, nb::arg("text"), "The ids of a text.")
      .def("decode", &NativeTokenizer::decode, nb::arg("ids"), "The text of ids.");

  nb::class_<NativeTokenDecoder>(m, "TokenDecoder", "Decodes a generation's text token by token.")
      .def(nb::init<std::shared_ptr<NativeTokenizer>>(), nb::arg("tokenizer"),
           "A decoder over a tokenizer: loom_token_decoder_create.")
      .def("push", &NativeTokenDecoder::push, nb::arg("token"), "The text the token completes.")
      .def("finish", &NativeTokenDecoder::finish, "What is still held back, at the end.");

  nb::class_<NativeServer>(m, "Server", "A serving bundle, running (see loom.Server).")
      .def(nb::init<const std::string &, const std::string &, int, int>(), nb::arg("bundle"), nb::arg("backend"),
           nb::arg("threads"), nb::arg("max_queue"), "Opens a serving bundle: loom_server_create.")
      .def("close", &NativeServer::close, "Cancels what runs and stops the server.")
      .def_prop_ro("closed", &NativeServer::closed, "Whether close() was called.")
      .def("submit", &NativeServer::submit, nb::arg("prompt"), nb::arg("max_new_tokens"), nb::arg("temperature"),
           nb::arg("top_k"), nb::arg("top_p"), nb::arg("repetition_penalty"), nb::arg("seed"),
           nb::arg("stop_tokens"), "Queues a request: loom_server_submit.")
      .def("tokenizer", &NativeServer::tokenizer, nb::sig("def tokenizer(self) -> Tokenizer | None"),
           "The bundle's tokenizer, or None.")
      .def("drain", &NativeServer::drain, "Refuses new requests and finishes the others.")
      .def("stats", &NativeServer::stats, "The server's counters: loom_server_stats.");
}
