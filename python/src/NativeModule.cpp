//===- NativeModule.cpp - loom._native: the runtime's C API for Python ----===//
//
// A thin layer over runtime/include/loom/runtime.h: every call goes through
// the public C API, whose status becomes loom.LoomError. Arrays cross as
// nanobind ndarrays (NumPy's buffer protocol or DLPack); the Python side
// (loom/session.py) adds keyword inputs and the DLPack stream handshake.
//
//===----------------------------------------------------------------------===//

#include "loom/runtime.h"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
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
}
