//===- LoomOps.cpp - Operations of the loom dialect -----------------------===//
//
// Verifiers and result-type inference. Every diagnostic names the concrete
// shapes or attribute at fault; nothing here asserts on user input.
//
//===----------------------------------------------------------------------===//

#include "dialects/loom/IR/LoomOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/OpImplementation.h"
#include "mlir/Interfaces/FunctionImplementation.h"
#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallSet.h"
#include <cmath>

using namespace mlir;
using namespace mlir::loom;

//===----------------------------------------------------------------------===//
// Shape helpers
//===----------------------------------------------------------------------===//

namespace {

bool isDyn(int64_t d) { return ShapedType::isDynamic(d); }

/// Two extents agree if equal or if either is still unknown.
bool compatible(int64_t a, int64_t b) { return isDyn(a) || isDyn(b) || a == b; }

bool compatibleShapes(ArrayRef<int64_t> a, ArrayRef<int64_t> b) {
  if (a.size() != b.size())
    return false;
  for (auto [x, y] : llvm::zip(a, b))
    if (!compatible(x, y))
      return false;
  return true;
}

bool compatibleTypes(Type a, Type b) {
  auto ta = dyn_cast<RankedTensorType>(a), tb = dyn_cast<RankedTensorType>(b);
  if (!ta || !tb)
    return a == b;
  return ta.getElementType() == tb.getElementType() &&
         compatibleShapes(ta.getShape(), tb.getShape());
}

/// Emits "'loom.<op>' op <message>" at `loc` when a location is known.
template <typename... Args>
LogicalResult inferError(std::optional<Location> loc, StringRef opName, Args &&...args) {
  return emitOptionalError(loc, "'", opName, "' op ", std::forward<Args>(args)...);
}

/// The ranked tensor type of `value`, or an error naming the operand.
FailureOr<RankedTensorType> rankedOperand(std::optional<Location> loc, StringRef opName,
                                          StringRef what, Value value) {
  auto type = dyn_cast<RankedTensorType>(value.getType());
  if (!type) {
    (void)inferError(loc, opName, what, " must be a ranked tensor, got ", value.getType());
    return failure();
  }
  return type;
}

/// NumPy broadcasting of two shapes; failure if some pair of extents clashes.
FailureOr<SmallVector<int64_t>> broadcastShapes(ArrayRef<int64_t> a, ArrayRef<int64_t> b) {
  size_t rank = std::max(a.size(), b.size());
  SmallVector<int64_t> out(rank);
  for (size_t i = 0; i < rank; ++i) {
    int64_t da = i + a.size() < rank ? 1 : a[i + a.size() - rank];
    int64_t db = i + b.size() < rank ? 1 : b[i + b.size() - rank];
    if (da == 1)
      out[i] = db;
    else if (db == 1)
      out[i] = da;
    else if (isDyn(da))
      out[i] = db;
    else if (isDyn(db) || da == db)
      out[i] = da;
    else
      return failure();
  }
  return out;
}

/// Normalises a possibly negative axis; failure when out of range.
FailureOr<int64_t> normaliseAxis(int64_t axis, int64_t rank) {
  int64_t norm = axis < 0 ? axis + rank : axis;
  if (norm < 0 || norm >= rank)
    return failure();
  return norm;
}

int64_t lastDim(RankedTensorType type) { return type.getDimSize(type.getRank() - 1); }

} // namespace

/// Result-type inference runs while parsing, before the op exists and before
/// its inherent attributes have moved into properties. This builds the
/// properties from the attribute dictionary when needed and reports a
/// missing or malformed attribute instead of dereferencing it.
template <typename OpT, typename = void>
struct HasProperties : std::false_type {};
template <typename OpT>
struct HasProperties<OpT, std::void_t<typename OpT::Properties>> : std::true_type {};

template <typename OpT, typename InferFn>
static LogicalResult inferWithAdaptor(MLIRContext *ctx, std::optional<Location> loc,
                                      ValueRange operands, DictionaryAttr attrs,
                                      OpaqueProperties props, RegionRange regions,
                                      SmallVectorImpl<Type> &types, InferFn infer) {
  // Default-valued attributes are materialised through the dictionary's context.
  if (!attrs)
    attrs = DictionaryAttr::get(ctx);
  if constexpr (HasProperties<OpT>::value) {
    typename OpT::Properties local;
    if (!props.as<void *>()) {
      Location where = loc ? *loc : UnknownLoc::get(ctx);
      if (failed(OpT::setPropertiesFromAttr(local, attrs, [&] {
            return emitError(where) << "'" << OpT::getOperationName() << "' op ";
          })))
        return failure();
      props = OpaqueProperties(&local);
      OperationName(OpT::getOperationName(), ctx).populateDefaultProperties(props);
    }
    typename OpT::Adaptor adaptor(operands, attrs, props, regions);
    if (failed(adaptor.verify(loc ? *loc : UnknownLoc::get(ctx))))
      return failure();
    return infer(ctx, loc, adaptor, types);
  } else {
    return infer(ctx, loc, typename OpT::Adaptor(operands, attrs, props, regions), types);
  }
}

#define LOOM_INFER_WITH_ADAPTOR(OP)                                                             \
  LogicalResult OP::inferReturnTypes(MLIRContext *ctx, std::optional<Location> loc,            \
                                     ValueRange operands, DictionaryAttr attrs,                \
                                     OpaqueProperties props, RegionRange regions,              \
                                     SmallVectorImpl<Type> &types) {                           \
    return inferWithAdaptor<OP>(ctx, loc, operands, attrs, props, regions, types, infer##OP);  \
  }

//===----------------------------------------------------------------------===//
// ParamOp / GetOp
//===----------------------------------------------------------------------===//

LogicalResult ParamOp::verify() {
  auto type = dyn_cast<RankedTensorType>(getType());
  if (!type)
    return emitOpError() << "expects a ranked tensor type, got " << getType();
  if (!type.hasStaticShape())
    return emitOpError() << "parameter @" << getSymName()
                         << " needs a static shape, got " << type;
  return success();
}

ParamOp GetOp::lookupParam() {
  // Block-local parameters first, then module-level ones.
  for (Operation *scope = (*this)->getParentOp(); scope; scope = scope->getParentOp()) {
    if (!scope->hasTrait<OpTrait::SymbolTable>())
      continue;
    if (auto param = dyn_cast_or_null<ParamOp>(
            SymbolTable::lookupSymbolIn(scope, getNameAttr().getAttr())))
      return param;
  }
  return {};
}

LogicalResult GetOp::verifySymbolUses(SymbolTableCollection &) {
  ParamOp param = lookupParam();
  if (!param)
    return emitOpError() << "reads @" << getName()
                         << ", which is not a loom.param in this block or module";
  if (param.getType() != getType())
    return emitOpError() << "reads @" << getName() << " as " << getType()
                         << " but it is declared as " << param.getType();
  return success();
}

//===----------------------------------------------------------------------===//
// BlockOp / YieldOp / RepeatOp
//===----------------------------------------------------------------------===//

ParseResult BlockOp::parse(OpAsmParser &parser, OperationState &result) {
  auto buildType = [](Builder &builder, ArrayRef<Type> args, ArrayRef<Type> results,
                      function_interface_impl::VariadicFlag, std::string &) {
    return builder.getFunctionType(args, results);
  };
  return function_interface_impl::parseFunctionOp(
      parser, result, /*allowVariadic=*/false, getFunctionTypeAttrName(result.name), buildType,
      getArgAttrsAttrName(result.name), getResAttrsAttrName(result.name));
}

void BlockOp::print(OpAsmPrinter &p) {
  function_interface_impl::printFunctionOp(p, *this, /*isVariadic=*/false,
                                           getFunctionTypeAttrName(), getArgAttrsAttrName(),
                                           getResAttrsAttrName());
}

LogicalResult BlockOp::verify() {
  if (getBody().empty())
    return emitOpError() << "@" << getSymName() << " needs a body";
  for (Type type : getArgumentTypes())
    if (!isa<RankedTensorType>(type))
      return emitOpError() << "arguments must be ranked tensors, got " << type;
  return success();
}

LogicalResult YieldOp::verify() {
  auto block = cast<BlockOp>((*this)->getParentOp());
  ArrayRef<Type> expected = block.getResultTypes();
  if (getValues().size() != expected.size())
    return emitOpError() << "yields " << getValues().size() << " values but @"
                         << block.getSymName() << " returns " << expected.size();
  for (auto [i, pair] : llvm::enumerate(llvm::zip(getValues().getTypes(), expected))) {
    auto [got, want] = pair;
    if (!compatibleTypes(got, want))
      return emitOpError() << "value #" << i << " has type " << got << " but @"
                           << block.getSymName() << " returns " << want;
  }
  return success();
}

BlockOp RepeatOp::lookupBlock() {
  auto module = (*this)->getParentOfType<ModuleOp>();
  if (!module)
    return {};
  return dyn_cast_or_null<BlockOp>(SymbolTable::lookupSymbolIn(module, getBlockAttr().getAttr()));
}

LogicalResult RepeatOp::verify() {
  // getCount() is unsigned: read the attribute as written, so -1 is -1.
  int64_t count = getCountAttr().getInt();
  if (count < 1 || count > kMaxCount)
    return emitOpError() << "count must be between 1 and " << kMaxCount << ", got " << count;
  return success();
}

LogicalResult RepeatOp::verifySymbolUses(SymbolTableCollection &) {
  BlockOp block = lookupBlock();
  if (!block)
    return emitOpError() << "@" << getBlock() << " is not a loom.block of this module";
  ArrayRef<Type> args = block.getArgumentTypes(), outs = block.getResultTypes();
  if (args.size() != getInputs().size())
    return emitOpError() << "passes " << getInputs().size() << " inputs but @" << getBlock()
                         << " takes " << args.size();
  for (auto [i, pair] : llvm::enumerate(llvm::zip(getInputs().getTypes(), args))) {
    auto [got, want] = pair;
    if (!compatibleTypes(got, want))
      return emitOpError() << "input #" << i << " has type " << got << " but @" << getBlock()
                           << " expects " << want;
  }
  if (outs.size() != getResults().size())
    return emitOpError() << "has " << getResults().size() << " results but @" << getBlock()
                         << " returns " << outs.size();
  for (auto [i, pair] : llvm::enumerate(llvm::zip(getResults().getTypes(), outs))) {
    auto [got, want] = pair;
    if (!compatibleTypes(got, want))
      return emitOpError() << "result #" << i << " has type " << got << " but @" << getBlock()
                           << " returns " << want;
  }
  if (getCount() > 1) {
    if (outs.size() != args.size())
      return emitOpError() << "repeats @" << getBlock() << " " << getCount()
                           << " times, so its results must match its arguments";
    for (auto [i, pair] : llvm::enumerate(llvm::zip(outs, args))) {
      auto [out, arg] = pair;
      if (!compatibleTypes(out, arg))
        return emitOpError() << "repeats @" << getBlock() << " " << getCount()
                             << " times, but its result #" << i << " (" << out
                             << ") does not match its argument (" << arg << ")";
    }
  }
  return success();
}

//===----------------------------------------------------------------------===//
// Elementwise
//===----------------------------------------------------------------------===//

static LogicalResult inferBinary(std::optional<Location> loc, StringRef opName, Value lhs,
                                 Value rhs, SmallVectorImpl<Type> &inferred) {
  auto a = rankedOperand(loc, opName, "lhs", lhs);
  auto b = rankedOperand(loc, opName, "rhs", rhs);
  if (failed(a) || failed(b))
    return failure();
  if (a->getElementType() != b->getElementType())
    return inferError(loc, opName, "operands have different element types: ", *a, " and ", *b,
                      "; insert loom.cast");
  auto shape = broadcastShapes(a->getShape(), b->getShape());
  if (failed(shape))
    return inferError(loc, opName, "cannot broadcast ", *a, " with ", *b);
  inferred.push_back(RankedTensorType::get(*shape, a->getElementType()));
  return success();
}

#define LOOM_BINARY_INFER(OP, NAME)                                                             \
  static LogicalResult infer##OP(MLIRContext *, std::optional<Location> loc,                  \
                                 OP::Adaptor adaptor, SmallVectorImpl<Type> &inferred) {       \
    return inferBinary(loc, NAME, adaptor.getLhs(), adaptor.getRhs(), inferred);               \
  }                                                                                            \
  LOOM_INFER_WITH_ADAPTOR(OP)
LOOM_BINARY_INFER(AddOp, "loom.add")
LOOM_BINARY_INFER(SubOp, "loom.sub")
LOOM_BINARY_INFER(MulOp, "loom.mul")
LOOM_BINARY_INFER(DivOp, "loom.div")
#undef LOOM_BINARY_INFER

//===----------------------------------------------------------------------===//
// Matmul and reductions
//===----------------------------------------------------------------------===//

static LogicalResult inferMatmulOp(MLIRContext *, std::optional<Location> loc,
                                         MatmulOp::Adaptor adaptor,
                                         SmallVectorImpl<Type> &inferred) {
  StringRef name = "loom.matmul";
  auto a = rankedOperand(loc, name, "lhs", adaptor.getLhs());
  auto b = rankedOperand(loc, name, "rhs", adaptor.getRhs());
  if (failed(a) || failed(b))
    return failure();
  if (a->getRank() < 2 || b->getRank() < 2)
    return inferError(loc, name, "operands need rank >= 2, got ", *a, " and ", *b);
  if (a->getElementType() != b->getElementType())
    return inferError(loc, name, "operands have different element types: ", *a, " and ", *b,
                      "; insert loom.cast");
  int64_t ra = a->getRank(), rb = b->getRank();
  int64_t m = a->getDimSize(ra - 2), ka = a->getDimSize(ra - 1);
  if (adaptor.getTransposeA())
    std::swap(m, ka);
  int64_t kb = b->getDimSize(rb - 2), n = b->getDimSize(rb - 1);
  if (adaptor.getTransposeB())
    std::swap(kb, n);
  if (!compatible(ka, kb))
    return inferError(loc, name, "contraction dimensions differ: lhs ", *a, " has K = ", ka,
                      " but rhs ", *b, " has K = ", kb);
  auto batch = broadcastShapes(a->getShape().drop_back(2), b->getShape().drop_back(2));
  if (failed(batch))
    return inferError(loc, name, "batch dimensions of ", *a, " and ", *b, " do not broadcast");
  SmallVector<int64_t> shape(*batch);
  shape.push_back(m);
  shape.push_back(n);
  inferred.push_back(RankedTensorType::get(shape, a->getElementType()));
  return success();
}

template <typename ReduceOp>
static LogicalResult inferReduce(std::optional<Location> loc, StringRef name,
                                 typename ReduceOp::Adaptor adaptor,
                                 SmallVectorImpl<Type> &inferred) {
  auto x = rankedOperand(loc, name, "input", adaptor.getX());
  if (failed(x))
    return failure();
  llvm::SmallSet<int64_t, 4> reduced;
  for (int64_t axis : adaptor.getAxes()) {
    auto norm = normaliseAxis(axis, x->getRank());
    if (failed(norm))
      return inferError(loc, name, "axis ", axis, " is out of range for ", *x);
    if (!reduced.insert(*norm).second)
      return inferError(loc, name, "axis ", axis, " is listed twice");
  }
  if (reduced.empty())
    return inferError(loc, name, "needs at least one axis to reduce");
  SmallVector<int64_t> shape;
  for (int64_t d = 0; d < x->getRank(); ++d) {
    if (!reduced.contains(d))
      shape.push_back(x->getDimSize(d));
    else if (adaptor.getKeepdim())
      shape.push_back(1);
  }
  inferred.push_back(RankedTensorType::get(shape, x->getElementType()));
  return success();
}

#define LOOM_REDUCE_INFER(OP, NAME)                                                             \
  static LogicalResult infer##OP(MLIRContext *, std::optional<Location> loc,                  \
                                 OP::Adaptor adaptor, SmallVectorImpl<Type> &inferred) {       \
    return inferReduce<OP>(loc, NAME, adaptor, inferred);                                      \
  }                                                                                            \
  LOOM_INFER_WITH_ADAPTOR(OP)
LOOM_REDUCE_INFER(ReduceSumOp, "loom.reduce_sum")
LOOM_REDUCE_INFER(ReduceMaxOp, "loom.reduce_max")
LOOM_REDUCE_INFER(ReduceMeanOp, "loom.reduce_mean")
#undef LOOM_REDUCE_INFER

LogicalResult AllReduceOp::verify() {
  StringRef r = getReduction();
  if (r != "sum" && r != "mean" && r != "max")
    return emitOpError() << "reduction must be \"sum\", \"mean\" or \"max\", got \"" << r << "\"";
  if (getGroup().empty())
    return emitOpError() << "needs a group (a mesh axis such as \"tp\")";
  return success();
}

LogicalResult SoftmaxOp::verify() {
  auto type = cast<RankedTensorType>(getX().getType());
  if (failed(normaliseAxis(getAxis(), type.getRank())))
    return emitOpError() << "axis " << getAxis() << " is out of range for " << type;
  return success();
}

//===----------------------------------------------------------------------===//
// Normalisation
//===----------------------------------------------------------------------===//

/// Checks that a per-feature parameter is a vector of `features` elements of
/// the input's element type.
static LogicalResult verifyFeatureParam(Operation *op, StringRef what, Type paramType,
                                        RankedTensorType input, int64_t features) {
  auto type = cast<RankedTensorType>(paramType);
  if (type.getRank() != 1 || !compatible(type.getDimSize(0), features))
    return op->emitOpError() << what << " must be "
                             << RankedTensorType::get({features}, input.getElementType())
                             << " to match input " << input << ", got " << type;
  if (type.getElementType() != input.getElementType())
    return op->emitOpError() << what << " has element type " << type.getElementType()
                             << " but input " << input << " has "
                             << input.getElementType();
  return success();
}

static LogicalResult verifyEps(Operation *op, double eps) {
  if (!(eps > 0.0))
    return op->emitOpError() << "eps must be positive, got " << eps;
  if (std::isinf(eps)) // normalises every row to zero
    return op->emitOpError() << "eps must be finite, got " << eps;
  return success();
}

LogicalResult LayerNormOp::verify() {
  auto x = cast<RankedTensorType>(getX().getType());
  if (x.getRank() < 1)
    return emitOpError() << "input must have rank >= 1, got " << x;
  if (failed(verifyFeatureParam(*this, "gamma", getGamma().getType(), x, lastDim(x))) ||
      failed(verifyFeatureParam(*this, "beta", getBeta().getType(), x, lastDim(x))))
    return failure();
  return verifyEps(*this, getEps().convertToDouble());
}

LogicalResult RMSNormOp::verify() {
  auto x = cast<RankedTensorType>(getX().getType());
  if (x.getRank() < 1)
    return emitOpError() << "input must have rank >= 1, got " << x;
  if (failed(verifyFeatureParam(*this, "gamma", getGamma().getType(), x, lastDim(x))))
    return failure();
  return verifyEps(*this, getEps().convertToDouble());
}

LogicalResult BatchNormOp::verify() {
  auto x = cast<RankedTensorType>(getX().getType());
  if (x.getRank() < 2)
    return emitOpError() << "input must be [N, C, ...] with rank >= 2, got " << x;
  int64_t channels = x.getDimSize(getLayout() == "nhwc" ? x.getRank() - 1 : 1);
  if (failed(verifyFeatureParam(*this, "gamma", getGamma().getType(), x, channels)) ||
      failed(verifyFeatureParam(*this, "beta", getBeta().getType(), x, channels)))
    return failure();
  return verifyEps(*this, getEps().convertToDouble());
}

//===----------------------------------------------------------------------===//
// Transformer building blocks
//===----------------------------------------------------------------------===//

static LogicalResult inferEmbeddingOp(MLIRContext *, std::optional<Location> loc,
                                            EmbeddingOp::Adaptor adaptor,
                                            SmallVectorImpl<Type> &inferred) {
  StringRef name = "loom.embedding";
  auto table = rankedOperand(loc, name, "table", adaptor.getTable());
  auto ids = rankedOperand(loc, name, "ids", adaptor.getIds());
  if (failed(table) || failed(ids))
    return failure();
  if (table->getRank() != 2)
    return inferError(loc, name, "table must be [vocab, hidden], got ", *table);
  SmallVector<int64_t> shape(ids->getShape());
  shape.push_back(table->getDimSize(1));
  inferred.push_back(RankedTensorType::get(shape, table->getElementType()));
  return success();
}

LogicalResult RotaryOp::verify() {
  auto x = cast<RankedTensorType>(getX().getType());
  if (x.getRank() != 3)
    return emitOpError() << "input must be [batch, seq, heads * head_dim], got " << x;
  if (getNumHeads() < 1)
    return emitOpError() << "num_heads must be at least 1, got " << getNumHeads();
  int64_t width = lastDim(x);
  if (!isDyn(width)) {
    if (width % getNumHeads() != 0)
      return emitOpError() << "last dimension " << width << " of " << x
                           << " is not divisible by num_heads = " << getNumHeads();
    if ((width / getNumHeads()) % 2 != 0)
      return emitOpError() << "head dimension " << width / getNumHeads()
                           << " must be even to rotate pairs";
  }
  if (!(getTheta().convertToDouble() > 0.0))
    return emitOpError() << "theta must be positive, got " << getTheta().convertToDouble();
  return success();
}

static LogicalResult inferAttentionOp(MLIRContext *, std::optional<Location> loc,
                                            AttentionOp::Adaptor adaptor,
                                            SmallVectorImpl<Type> &inferred) {
  StringRef name = "loom.attention";
  auto q = rankedOperand(loc, name, "q", adaptor.getQ());
  auto k = rankedOperand(loc, name, "k", adaptor.getK());
  auto v = rankedOperand(loc, name, "v", adaptor.getV());
  if (failed(q) || failed(k) || failed(v))
    return failure();
  for (RankedTensorType t : {*q, *k, *v})
    if (t.getRank() != 3)
      return inferError(loc, name, "q, k and v must be [batch, seq, heads * head_dim], got ",
                        t);
  if (q->getElementType() != k->getElementType() || k->getElementType() != v->getElementType())
    return inferError(loc, name, "q, k and v must share an element type, got ", *q, ", ", *k,
                      " and ", *v);
  int64_t heads = adaptor.getNumHeads();
  int64_t kvHeads = adaptor.getNumKvHeads() ? *adaptor.getNumKvHeads() : heads;
  if (heads < 1 || kvHeads < 1)
    return inferError(loc, name, "num_heads (", heads, ") and num_kv_heads (", kvHeads,
                      ") must be at least 1");
  if (heads % kvHeads != 0)
    return inferError(loc, name, "num_heads = ", heads,
                      " must be a multiple of num_kv_heads = ", kvHeads);
  int64_t qWidth = lastDim(*q);
  if (!isDyn(qWidth) && qWidth % heads != 0)
    return inferError(loc, name, "last dimension ", qWidth, " of q ", *q,
                      " is not divisible by num_heads = ", heads);
  if (!isDyn(qWidth) && !compatible(lastDim(*k), qWidth / heads * kvHeads))
    return inferError(loc, name, "k ", *k, " must have last dimension num_kv_heads * head_dim = ",
                      kvHeads, " * ", qWidth / heads, " = ", qWidth / heads * kvHeads);
  if (!compatibleShapes(k->getShape(), v->getShape()))
    return inferError(loc, name, "k ", *k, " and v ", *v, " must have the same shape");
  if (!compatible(q->getDimSize(0), k->getDimSize(0)))
    return inferError(loc, name, "batch of q ", *q, " differs from batch of k ", *k);
  if (adaptor.getScale() && !(adaptor.getScale()->convertToDouble() > 0.0))
    return inferError(loc, name, "scale must be positive");
  inferred.push_back(*q);
  return success();
}

static LogicalResult inferCrossEntropyOp(MLIRContext *ctx, std::optional<Location> loc,
                                               CrossEntropyOp::Adaptor adaptor,
                                               SmallVectorImpl<Type> &inferred) {
  StringRef name = "loom.cross_entropy";
  auto logits = rankedOperand(loc, name, "logits", adaptor.getLogits());
  auto targets = rankedOperand(loc, name, "targets", adaptor.getTargets());
  if (failed(logits) || failed(targets))
    return failure();
  if (logits->getRank() < 1 ||
      !compatibleShapes(logits->getShape().drop_back(), targets->getShape()))
    return inferError(loc, name, "targets ", *targets, " must have the shape of logits ",
                      *logits, " without its last (class) dimension");
  inferred.push_back(RankedTensorType::get({}, Float32Type::get(ctx)));
  return success();
}

//===----------------------------------------------------------------------===//
// Shape manipulation
//===----------------------------------------------------------------------===//

LogicalResult ReshapeOp::verify() {
  auto in = cast<RankedTensorType>(getX().getType());
  auto out = cast<RankedTensorType>(getResult().getType());
  if (in.getElementType() != out.getElementType())
    return emitOpError() << "cannot change the element type (" << in << " to " << out
                         << "); use loom.cast";
  if (llvm::count_if(out.getShape(), isDyn) > 1)
    return emitOpError() << "result " << out << " may have at most one dynamic dimension";
  if (in.hasStaticShape() && out.hasStaticShape() &&
      in.getNumElements() != out.getNumElements())
    return emitOpError() << "cannot reshape " << in << " (" << in.getNumElements()
                         << " elements) to " << out << " (" << out.getNumElements()
                         << " elements)";
  if (!in.hasStaticShape() && out.hasStaticShape())
    return emitOpError() << "cannot reshape dynamic " << in << " to static " << out
                         << "; keep the unknown dimension dynamic";
  return success();
}

static LogicalResult inferTransposeOp(MLIRContext *, std::optional<Location> loc,
                                            TransposeOp::Adaptor adaptor,
                                            SmallVectorImpl<Type> &inferred) {
  StringRef name = "loom.transpose";
  auto x = rankedOperand(loc, name, "input", adaptor.getX());
  if (failed(x))
    return failure();
  ArrayRef<int64_t> perm = adaptor.getPermutation();
  if (static_cast<int64_t>(perm.size()) != x->getRank())
    return inferError(loc, name, "permutation has ", perm.size(), " entries but ", *x,
                      " has rank ", x->getRank());
  SmallVector<bool> seen(perm.size(), false);
  SmallVector<int64_t> shape;
  for (int64_t p : perm) {
    if (p < 0 || p >= x->getRank() || seen[p])
      return inferError(loc, name, "permutation must list each dimension of ", *x,
                        " exactly once");
    seen[p] = true;
    shape.push_back(x->getDimSize(p));
  }
  inferred.push_back(RankedTensorType::get(shape, x->getElementType()));
  return success();
}

static LogicalResult inferSliceOp(MLIRContext *, std::optional<Location> loc,
                                        SliceOp::Adaptor adaptor,
                                        SmallVectorImpl<Type> &inferred) {
  StringRef name = "loom.slice";
  auto x = rankedOperand(loc, name, "input", adaptor.getX());
  if (failed(x))
    return failure();
  auto axis = normaliseAxis(adaptor.getAxis(), x->getRank());
  if (failed(axis))
    return inferError(loc, name, "axis ", adaptor.getAxis(), " is out of range for ", *x);
  int64_t start = adaptor.getStart(), size = adaptor.getSize();
  int64_t extent = x->getDimSize(*axis);
  if (start < 0 || size < 1)
    return inferError(loc, name, "needs start >= 0 and size >= 1, got start = ", start,
                      ", size = ", size);
  if (!isDyn(extent) && start + size > extent)
    return inferError(loc, name, "range [", start, ", ", start + size, ") exceeds dimension ",
                      *axis, " of ", *x, " (size ", extent, ")");
  SmallVector<int64_t> shape(x->getShape());
  shape[*axis] = size;
  inferred.push_back(RankedTensorType::get(shape, x->getElementType()));
  return success();
}

static LogicalResult inferConcatOp(MLIRContext *, std::optional<Location> loc,
                                         ConcatOp::Adaptor adaptor,
                                         SmallVectorImpl<Type> &inferred) {
  StringRef name = "loom.concat";
  if (adaptor.getInputs().empty())
    return inferError(loc, name, "needs at least one input");
  auto first = rankedOperand(loc, name, "input #0", adaptor.getInputs().front());
  if (failed(first))
    return failure();
  auto axis = normaliseAxis(adaptor.getAxis(), first->getRank());
  if (failed(axis))
    return inferError(loc, name, "axis ", adaptor.getAxis(), " is out of range for ", *first);
  SmallVector<int64_t> shape(first->getShape());
  for (auto [i, value] : llvm::enumerate(adaptor.getInputs().drop_front())) {
    auto t = rankedOperand(loc, name, "input", value);
    if (failed(t))
      return failure();
    if (t->getRank() != first->getRank() || t->getElementType() != first->getElementType())
      return inferError(loc, name, "input #", i + 1, " ", *t,
                        " must have the rank and element type of input #0 ", *first);
    for (int64_t d = 0; d < t->getRank(); ++d) {
      if (d == *axis) {
        shape[d] = isDyn(shape[d]) || t->isDynamicDim(d) ? ShapedType::kDynamic
                                                         : shape[d] + t->getDimSize(d);
      } else if (!compatible(shape[d], t->getDimSize(d))) {
        return inferError(loc, name, "input #", i + 1, " ", *t, " differs from input #0 ",
                          *first, " in dimension ", d);
      }
    }
  }
  inferred.push_back(RankedTensorType::get(shape, first->getElementType()));
  return success();
}

LogicalResult BroadcastOp::verify() {
  auto in = cast<RankedTensorType>(getX().getType());
  auto out = cast<RankedTensorType>(getResult().getType());
  if (in.getElementType() != out.getElementType())
    return emitOpError() << "cannot change the element type (" << in << " to " << out << ")";
  auto shape = broadcastShapes(in.getShape(), out.getShape());
  if (in.getRank() > out.getRank() || failed(shape) ||
      !compatibleShapes(*shape, out.getShape()))
    return emitOpError() << "cannot broadcast " << in << " to " << out;
  return success();
}

LogicalResult CastOp::verify() {
  auto in = cast<RankedTensorType>(getX().getType());
  auto out = cast<RankedTensorType>(getResult().getType());
  if (!compatibleShapes(in.getShape(), out.getShape()))
    return emitOpError() << "cast changes only the element type, but " << in << " and " << out
                         << " differ in shape";
  return success();
}

//===----------------------------------------------------------------------===//
// Convolutional networks
//===----------------------------------------------------------------------===//

/// Output extent of a sliding window, or failure when the window does not fit.
static FailureOr<int64_t> windowExtent(int64_t in, int64_t kernel, int64_t stride,
                                       int64_t padding) {
  if (isDyn(in))
    return ShapedType::kDynamic;
  int64_t span = in + 2 * padding - kernel;
  if (span < 0)
    return failure();
  return span / stride + 1;
}

static LogicalResult inferConv2DOp(MLIRContext *, std::optional<Location> loc,
                                         Conv2DOp::Adaptor adaptor,
                                         SmallVectorImpl<Type> &inferred) {
  StringRef name = "loom.conv2d";
  auto x = rankedOperand(loc, name, "input", adaptor.getX());
  auto w = rankedOperand(loc, name, "filter", adaptor.getFilter());
  if (failed(x) || failed(w))
    return failure();
  bool nhwc = adaptor.getLayout() == "nhwc";
  if (x->getRank() != 4 || w->getRank() != 4)
    return inferError(loc, name,
                      nhwc ? "expects input [N, H, W, C] and filter [O, KH, KW, C/groups], got "
                           : "expects input [N, C, H, W] and filter [O, C/groups, KH, KW], got ",
                      *x, " and ", *w);
  // Dimension positions: channels, height, width (of x; the filter's
  // kernel height and width sit at the same places, its channels too).
  int64_t dc = nhwc ? 3 : 1, dh = nhwc ? 1 : 2, dw = nhwc ? 2 : 3;
  if (x->getElementType() != w->getElementType())
    return inferError(loc, name, "input ", *x, " and filter ", *w,
                      " have different element types");
  int64_t stride = adaptor.getStride(), padding = adaptor.getPadding(),
          groups = adaptor.getGroups();
  if (stride < 1 || padding < 0 || groups < 1)
    return inferError(loc, name, "needs stride >= 1, padding >= 0 and groups >= 1, got ",
                      stride, ", ", padding, " and ", groups);
  if (!isDyn(x->getDimSize(dc)) && x->getDimSize(dc) != w->getDimSize(dc) * groups)
    return inferError(loc, name, "input has ", x->getDimSize(dc), " channels but filter ", *w,
                      " with groups = ", groups, " expects ", w->getDimSize(dc) * groups);
  if (w->getDimSize(0) % groups != 0)
    return inferError(loc, name, "output channels ", w->getDimSize(0),
                      " are not divisible by groups = ", groups);
  auto h = windowExtent(x->getDimSize(dh), w->getDimSize(dh), stride, padding);
  auto wd = windowExtent(x->getDimSize(dw), w->getDimSize(dw), stride, padding);
  if (failed(h) || failed(wd))
    return inferError(loc, name, "filter ", *w, " does not fit input ", *x, " with padding ",
                      padding);
  int64_t n = x->getDimSize(0), o = w->getDimSize(0);
  SmallVector<int64_t> shape = nhwc ? SmallVector<int64_t>{n, *h, *wd, o} : SmallVector<int64_t>{n, o, *h, *wd};
  inferred.push_back(RankedTensorType::get(shape, x->getElementType()));
  return success();
}

template <typename PoolOp>
static LogicalResult inferPool(std::optional<Location> loc, StringRef name,
                               typename PoolOp::Adaptor adaptor,
                               SmallVectorImpl<Type> &inferred) {
  auto x = rankedOperand(loc, name, "input", adaptor.getX());
  if (failed(x))
    return failure();
  bool nhwc = adaptor.getLayout() == "nhwc";
  if (x->getRank() != 4)
    return inferError(loc, name, nhwc ? "expects input [N, H, W, C], got " : "expects input [N, C, H, W], got ", *x);
  int64_t dh = nhwc ? 1 : 2, dw = nhwc ? 2 : 3;
  int64_t kernel = adaptor.getKernel(), stride = adaptor.getStride(),
          padding = adaptor.getPadding();
  if (kernel < 1 || stride < 1 || padding < 0 || padding * 2 >= kernel + 1)
    return inferError(loc, name, "needs kernel >= 1, stride >= 1 and 0 <= padding <= kernel/2, got ",
                      kernel, ", ", stride, " and ", padding);
  auto h = windowExtent(x->getDimSize(dh), kernel, stride, padding);
  auto w = windowExtent(x->getDimSize(dw), kernel, stride, padding);
  if (failed(h) || failed(w))
    return inferError(loc, name, "window ", kernel, " does not fit input ", *x);
  int64_t n = x->getDimSize(0), c = x->getDimSize(nhwc ? 3 : 1);
  SmallVector<int64_t> shape = nhwc ? SmallVector<int64_t>{n, *h, *w, c} : SmallVector<int64_t>{n, c, *h, *w};
  inferred.push_back(RankedTensorType::get(shape, x->getElementType()));
  return success();
}

static LogicalResult inferMaxPool2DOp(MLIRContext *, std::optional<Location> loc,
                                            MaxPool2DOp::Adaptor adaptor,
                                            SmallVectorImpl<Type> &inferred) {
  return inferPool<MaxPool2DOp>(loc, "loom.max_pool2d", adaptor, inferred);
}

static LogicalResult inferAvgPool2DOp(MLIRContext *, std::optional<Location> loc,
                                            AvgPool2DOp::Adaptor adaptor,
                                            SmallVectorImpl<Type> &inferred) {
  return inferPool<AvgPool2DOp>(loc, "loom.avg_pool2d", adaptor, inferred);
}

LOOM_INFER_WITH_ADAPTOR(MatmulOp)
LOOM_INFER_WITH_ADAPTOR(EmbeddingOp)
LOOM_INFER_WITH_ADAPTOR(AttentionOp)
LOOM_INFER_WITH_ADAPTOR(CrossEntropyOp)
LOOM_INFER_WITH_ADAPTOR(TransposeOp)
LOOM_INFER_WITH_ADAPTOR(SliceOp)

/// The collectives along an axis: `parts` of x concatenated (gather), or x
/// cut into `parts` equal slices (scatter), along `axis`.
static LogicalResult inferAlongAxis(std::optional<Location> loc, StringRef name, Value input, int64_t axisAttr,
                                    int64_t parts, bool gather, SmallVectorImpl<Type> &inferred) {
  auto x = rankedOperand(loc, name, "input", input);
  if (failed(x))
    return failure();
  auto axis = normaliseAxis(axisAttr, x->getRank());
  if (failed(axis))
    return inferError(loc, name, "axis ", axisAttr, " is out of range for ", *x);
  if (parts < 1)
    return inferError(loc, name, "needs parts >= 1, got ", parts);
  SmallVector<int64_t> shape(x->getShape());
  if (!isDyn(shape[*axis])) {
    if (!gather && shape[*axis] % parts != 0)
      return inferError(loc, name, "cannot split dimension ", *axis, " of ", *x, " into ", parts,
                        " equal parts");
    shape[*axis] = gather ? shape[*axis] * parts : shape[*axis] / parts;
  }
  inferred.push_back(RankedTensorType::get(shape, x->getElementType()));
  return success();
}

static LogicalResult inferAllGatherOp(MLIRContext *, std::optional<Location> loc,
                                      AllGatherOp::Adaptor adaptor, SmallVectorImpl<Type> &inferred) {
  return inferAlongAxis(loc, "loom.all_gather", adaptor.getX(), adaptor.getAxis(), adaptor.getParts(),
                        /*gather=*/true, inferred);
}
LOOM_INFER_WITH_ADAPTOR(AllGatherOp)

static LogicalResult inferReduceScatterOp(MLIRContext *, std::optional<Location> loc,
                                          ReduceScatterOp::Adaptor adaptor, SmallVectorImpl<Type> &inferred) {
  return inferAlongAxis(loc, "loom.reduce_scatter", adaptor.getX(), adaptor.getAxis(), adaptor.getParts(),
                        /*gather=*/false, inferred);
}
LOOM_INFER_WITH_ADAPTOR(ReduceScatterOp)
LOOM_INFER_WITH_ADAPTOR(ConcatOp)
LOOM_INFER_WITH_ADAPTOR(Conv2DOp)
LOOM_INFER_WITH_ADAPTOR(MaxPool2DOp)
LOOM_INFER_WITH_ADAPTOR(AvgPool2DOp)

#define GET_OP_CLASSES
#include "dialects/loom/IR/LoomOps.cpp.inc"
