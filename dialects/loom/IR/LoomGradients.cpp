//===- LoomGradients.cpp - Gradient rules of the loom ops -----------------===//
//
// Each differentiable op's vector-Jacobian product, in terms of other ops and
// a few gradient kernels (layernorm_grad, attention_grad, ...) that the
// backends implement. Rules skip operands that need no gradient.
//
//===----------------------------------------------------------------------===//

#include "dialects/loom/IR/LoomOps.h"
#include "mlir/IR/Builders.h"

using namespace mlir;
using namespace mlir::loom;

#include "dialects/loom/IR/LoomInterfaces.cpp.inc"

namespace {
using H = GradientBuilder::Handle;

NamedAttribute flag(GradientBuilder &b, StringRef name) {
  return NamedAttribute(StringAttr::get(b.getContext(), name), UnitAttr::get(b.getContext()));
}
NamedAttribute integer(GradientBuilder &b, StringRef name, int64_t v) {
  return NamedAttribute(StringAttr::get(b.getContext(), name),
                        IntegerAttr::get(IntegerType::get(b.getContext(), 64), v));
}
NamedAttribute real(GradientBuilder &b, StringRef name, double v) {
  return NamedAttribute(StringAttr::get(b.getContext(), name),
                        FloatAttr::get(Float64Type::get(b.getContext()), v));
}
NamedAttribute text(GradientBuilder &b, StringRef name, StringRef v) {
  return NamedAttribute(StringAttr::get(b.getContext(), name), StringAttr::get(b.getContext(), v));
}

/// Copies the op's own attributes (eps, num_heads, ...) for its gradient kernel.
SmallVector<NamedAttribute> attrsOf(Operation *op) {
  SmallVector<NamedAttribute> out;
  for (NamedAttribute a : op->getAttrDictionary())
    if (!a.getName().getValue().starts_with("loom."))
      out.push_back(a);
  return out;
}

/// dx = unary_grad(x, y, dy) for an elementwise function named `fn`.
LogicalResult unaryGrad(GradientBuilder &b, StringRef fn) {
  H dy = b.resultGrad();
  if (dy < 0 || !b.needsGrad(0))
    return success();
  b.addGrad(0, b.emit1("unary_grad", {b.operand(0), b.result(), dy}, b.operand(0),
                       {text(b, "fn", fn)}));
  return success();
}
} // namespace

//===--- Elementwise ------------------------------------------------------===//

LogicalResult AddOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy < 0)
    return success();
  if (b.needsGrad(0))
    b.addGrad(0, dy);
  if (b.needsGrad(1))
    b.addGrad(1, dy);
  return success();
}

LogicalResult SubOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy < 0)
    return success();
  if (b.needsGrad(0))
    b.addGrad(0, dy);
  if (b.needsGrad(1))
    b.addGrad(1, b.emit1("neg", {dy}, dy));
  return success();
}

LogicalResult MulOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy < 0)
    return success();
  if (b.needsGrad(0))
    b.addGrad(0, b.emit1("mul", {dy, b.operand(1)}, dy));
  if (b.needsGrad(1))
    b.addGrad(1, b.emit1("mul", {dy, b.operand(0)}, dy));
  return success();
}

LogicalResult DivOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy < 0)
    return success();
  H q = b.emit1("div", {dy, b.operand(1)}, dy); // dy / rhs
  if (b.needsGrad(0))
    b.addGrad(0, q);
  if (b.needsGrad(1)) // -dy * lhs / rhs^2 = -(dy / rhs) * result
    b.addGrad(1, b.emit1("neg", {b.emit1("mul", {q, b.result()}, dy)}, dy));
  return success();
}

LogicalResult GeluOp::buildGradient(GradientBuilder &b) {
  return unaryGrad(b, getApproximate() ? "gelu_tanh" : "gelu");
}
LogicalResult ReluOp::buildGradient(GradientBuilder &b) { return unaryGrad(b, "relu"); }
LogicalResult SiluOp::buildGradient(GradientBuilder &b) { return unaryGrad(b, "silu"); }
LogicalResult ExpOp::buildGradient(GradientBuilder &b) { return unaryGrad(b, "exp"); }
LogicalResult TanhOp::buildGradient(GradientBuilder &b) { return unaryGrad(b, "tanh"); }
LogicalResult RsqrtOp::buildGradient(GradientBuilder &b) { return unaryGrad(b, "rsqrt"); }

LogicalResult NegOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("neg", {dy}, dy));
  return success();
}

LogicalResult ScaleOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("scale", {dy}, dy, {real(b, "factor", getFactor().convertToDouble())}));
  return success();
}

//===--- Matmul -----------------------------------------------------------===//

LogicalResult MatmulOp::buildGradient(GradientBuilder &b) {
  H dc = b.resultGrad();
  if (dc < 0)
    return success();
  H a = b.operand(0), w = b.operand(1);
  bool ta = getTransposeA(), tb = getTransposeB();
  auto mm = [&](H x, H y, bool tx, bool ty, ArrayRef<int64_t> shape) {
    SmallVector<NamedAttribute> attrs;
    if (tx)
      attrs.push_back(flag(b, "transpose_a"));
    if (ty)
      attrs.push_back(flag(b, "transpose_b"));
    return b.emitShaped("matmul", {x, y}, shape, attrs);
  };
  SmallVector<int64_t> sa = b.shapeOf(a), sw = b.shapeOf(w), sc = b.shapeOf(dc);
  // A batched activation times a rank-2 weight: fold the batch into rows so
  // the weight gradient is one [K, N] product, not a batch of them.
  if (sw.size() == 2 && sa.size() > 2 && !ta) {
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < sa.size(); ++i)
      rows *= sa[i];
    H a2 = b.view(a, {rows, sa.back()}), dc2 = b.view(dc, {rows, sc.back()});
    if (b.needsGrad(0)) {
      H da2 = mm(dc2, w, false, !tb, {rows, sa.back()});
      b.addGrad(0, b.view(da2, sa));
    }
    if (b.needsGrad(1))
      b.addGrad(1, tb ? mm(dc2, a2, true, false, sw) : mm(a2, dc2, true, false, sw));
    return success();
  }
  // General batched case: batch dimensions as in the result, summed down by addGrad.
  auto withBatch = [&](ArrayRef<int64_t> matrix) {
    SmallVector<int64_t> shape(sc.begin(), sc.end() - 2);
    shape.append(matrix.end() - 2, matrix.end());
    return shape;
  };
  if (b.needsGrad(0))
    b.addGrad(0, ta ? mm(w, dc, tb, true, withBatch(sa)) : mm(dc, w, false, !tb, withBatch(sa)));
  if (b.needsGrad(1))
    b.addGrad(1, tb ? mm(dc, a, true, ta, withBatch(sw)) : mm(a, dc, !ta, false, withBatch(sw)));
  return success();
}

//===--- Reductions and normalisation --------------------------------------===//

static LogicalResult reduceGrad(GradientBuilder &b, ArrayRef<int64_t> axes, bool keep,
                                double factor) {
  H dy = b.resultGrad();
  if (dy < 0 || !b.needsGrad(0))
    return success();
  SmallVector<int64_t> in = b.shapeOf(b.operand(0)), kept(in);
  for (int64_t a : axes)
    kept[a < 0 ? a + in.size() : a] = 1;
  H g = keep ? dy : b.view(dy, kept);
  if (factor != 1.0)
    g = b.emit1("scale", {g}, g, {real(b, "factor", factor)});
  b.addGrad(0, b.emit1("broadcast", {g}, b.operand(0)));
  return success();
}

LogicalResult ReduceSumOp::buildGradient(GradientBuilder &b) {
  return reduceGrad(b, getAxes(), getKeepdim(), 1.0);
}

LogicalResult ReduceMeanOp::buildGradient(GradientBuilder &b) {
  SmallVector<int64_t> in = b.shapeOf(b.operand(0));
  double n = 1;
  for (int64_t a : getAxes())
    n *= in[a < 0 ? a + in.size() : a];
  return reduceGrad(b, getAxes(), getKeepdim(), 1.0 / n);
}

LogicalResult ReduceMaxOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("reduce_max_grad", {b.operand(0), b.result(), dy}, b.operand(0),
                         attrsOf(*this)));
  return success();
}

LogicalResult SoftmaxOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("softmax_grad", {b.result(), dy}, b.operand(0), attrsOf(*this)));
  return success();
}

LogicalResult LayerNormOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy < 0)
    return success();
  auto g = b.emit("layernorm_grad", {b.operand(0), b.operand(1), dy},
                  {b.operand(0), b.operand(1), b.operand(2)}, attrsOf(*this));
  for (unsigned i = 0; i < 3; ++i)
    if (b.needsGrad(i))
      b.addGrad(i, g[i]);
  return success();
}

LogicalResult RMSNormOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy < 0)
    return success();
  auto g = b.emit("rmsnorm_grad", {b.operand(0), b.operand(1), dy}, {b.operand(0), b.operand(1)},
                  attrsOf(*this));
  for (unsigned i = 0; i < 2; ++i)
    if (b.needsGrad(i))
      b.addGrad(i, g[i]);
  return success();
}

LogicalResult BatchNormOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy < 0)
    return success();
  auto g = b.emit("batchnorm_grad", {b.operand(0), b.operand(1), dy},
                  {b.operand(0), b.operand(1), b.operand(2)}, attrsOf(*this));
  for (unsigned i = 0; i < 3; ++i)
    if (b.needsGrad(i))
      b.addGrad(i, g[i]);
  return success();
}

//===--- Transformer pieces -----------------------------------------------===//

LogicalResult EmbeddingOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("embedding_grad", {b.operand(1), dy}, b.operand(0), attrsOf(*this)));
  return success();
}

LogicalResult RotaryOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy < 0 || !b.needsGrad(0))
    return success();
  SmallVector<NamedAttribute> attrs = attrsOf(*this);
  attrs.push_back(flag(b, "inverse")); // a rotation's transpose is its inverse
  b.addGrad(0, b.emit1("rotary", {dy}, dy, attrs));
  return success();
}

LogicalResult AttentionOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy < 0)
    return success();
  auto g = b.emit("attention_grad", {b.operand(0), b.operand(1), b.operand(2), dy},
                  {b.operand(0), b.operand(1), b.operand(2)}, attrsOf(*this));
  for (unsigned i = 0; i < 3; ++i)
    if (b.needsGrad(i))
      b.addGrad(i, g[i]);
  return success();
}

LogicalResult CrossEntropyOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("cross_entropy_grad", {b.operand(0), b.operand(1), dy}, b.operand(0),
                         attrsOf(*this)));
  return success();
}

//===--- Communication ----------------------------------------------------===//

LogicalResult AllReduceOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (getReduction() != "sum")
    return emitOpError() << "has no gradient rule for reduction \"" << getReduction() << "\"";
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, dy); // the result is replicated: each rank's share is the whole gradient
  return success();
}

// Sequence parallelism's pair: each is the other's gradient (the sum of every
// rank's gradient of the gathered whole, of which each keeps its own part;
// the parts of the scattered sum's gradient, gathered).
LogicalResult AllGatherOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("reduce_scatter", {dy}, b.operand(0),
                         {text(b, "group", getGroup()), integer(b, "axis", getAxis()),
                          integer(b, "parts", getParts()), text(b, "reduction", "sum")}));
  return success();
}

LogicalResult ReduceScatterOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("all_gather", {dy}, b.operand(0),
                         {text(b, "group", getGroup()), integer(b, "axis", getAxis()),
                          integer(b, "parts", getParts())}));
  return success();
}

LogicalResult GradAllReduceOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("all_reduce", {dy}, dy,
                         {text(b, "group", getGroup()), text(b, "reduction", "sum")}));
  return success();
}

//===--- Shape manipulation -----------------------------------------------===//

LogicalResult ReshapeOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.view(dy, b.shapeOf(b.operand(0))));
  return success();
}

LogicalResult TransposeOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy < 0 || !b.needsGrad(0))
    return success();
  ArrayRef<int64_t> perm = getPermutation();
  SmallVector<int64_t> inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i)
    inverse[perm[i]] = static_cast<int64_t>(i);
  Builder builder(b.getContext());
  b.addGrad(0, b.emit1("transpose", {dy}, b.operand(0),
                       {NamedAttribute(builder.getStringAttr("permutation"),
                                       builder.getDenseI64ArrayAttr(inverse))}));
  return success();
}

LogicalResult SliceOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("slice_grad", {dy}, b.operand(0), attrsOf(*this)));
  return success();
}

LogicalResult ConcatOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy < 0)
    return success();
  int64_t axis = getAxis(), start = 0;
  SmallVector<int64_t> shape = b.shapeOf(dy);
  if (axis < 0)
    axis += shape.size();
  for (unsigned i = 0; i < getInputs().size(); ++i) {
    int64_t size = b.shapeOf(b.operand(i))[axis];
    if (b.needsGrad(i))
      b.addGrad(i, b.emit1("slice", {dy}, b.operand(i),
                           {integer(b, "axis", axis), integer(b, "start", start),
                            integer(b, "size", size)}));
    start += size;
  }
  return success();
}

LogicalResult BroadcastOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, dy); // addGrad sums the broadcast dimensions away
  return success();
}

LogicalResult CastOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("cast", {dy}, b.operand(0)));
  return success();
}

//===--- Convolutional networks -------------------------------------------===//

LogicalResult Conv2DOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy < 0)
    return success();
  if (b.needsGrad(0))
    b.addGrad(0, b.emit1("conv2d_grad_input", {dy, b.operand(1)}, b.operand(0), attrsOf(*this)));
  if (b.needsGrad(1))
    b.addGrad(1, b.emit1("conv2d_grad_filter", {b.operand(0), dy}, b.operand(1), attrsOf(*this)));
  return success();
}

LogicalResult MaxPool2DOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("max_pool2d_grad", {b.operand(0), dy}, b.operand(0), attrsOf(*this)));
  return success();
}

LogicalResult AvgPool2DOp::buildGradient(GradientBuilder &b) {
  H dy = b.resultGrad();
  if (dy >= 0 && b.needsGrad(0))
    b.addGrad(0, b.emit1("avg_pool2d_grad", {dy}, b.operand(0), attrsOf(*this)));
  return success();
}
