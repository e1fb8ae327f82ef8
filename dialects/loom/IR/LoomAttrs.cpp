//===- LoomAttrs.cpp - Attributes of the loom dialect ---------------------===//
//
// Parsing, printing and verification of #loom.init, #loom.mesh and
// #loom.sharding.
//
//===----------------------------------------------------------------------===//

#include "dialects/loom/IR/LoomAttrs.h"
#include "dialects/loom/IR/LoomDialect.h"
#include "mlir/IR/DialectImplementation.h"
#include "llvm/ADT/APFloat.h"
#include "llvm/ADT/SmallString.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/ADT/TypeSwitch.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

using namespace mlir;
using namespace mlir::loom;

#include "dialects/loom/IR/LoomEnums.cpp.inc"
#define GET_ATTRDEF_CLASSES
#include "dialects/loom/IR/LoomAttrs.cpp.inc"

void LoomDialect::registerAttributes() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "dialects/loom/IR/LoomAttrs.cpp.inc"
      >();
}

/// Prints a double in its shortest exact decimal form (0.02, not 2.000000e-02).
static void printShortestDouble(AsmPrinter &printer, double value) {
  char text[32];
  for (int precision = 1; precision <= 17; ++precision) {
    snprintf(text, sizeof(text), "%.*g", precision, value);
    if (strtod(text, nullptr) == value)
      break;
  }
  StringRef str(text);
  printer << str;
  if (str.find_first_of(".eEn") == StringRef::npos)
    printer << ".0";
}

//===----------------------------------------------------------------------===//
// InitAttr
//===----------------------------------------------------------------------===//

static bool initKindTakesScale(InitKind kind) {
  return kind == InitKind::Normal || kind == InitKind::Uniform ||
         kind == InitKind::Constant;
}

Attribute InitAttr::parse(AsmParser &parser, Type) {
  StringRef keyword;
  SMLoc loc = parser.getCurrentLocation();
  if (parser.parseLess() || parser.parseKeyword(&keyword))
    return {};
  std::optional<InitKind> kind = symbolizeInitKind(keyword);
  if (!kind) {
    parser.emitError(loc) << "unknown initializer '" << keyword
                          << "'; expected zeros, ones, normal(std), "
                             "uniform(bound) or constant(value)";
    return {};
  }
  double scale = 0.0;
  if (initKindTakesScale(*kind)) {
    if (parser.parseLParen() || parser.parseFloat(scale) || parser.parseRParen())
      return {};
  }
  if (parser.parseGreater())
    return {};
  return parser.getChecked<InitAttr>(loc, parser.getContext(), *kind, APFloat(scale));
}

void InitAttr::print(AsmPrinter &printer) const {
  printer << "<" << stringifyInitKind(getKind());
  if (initKindTakesScale(getKind())) {
    printer << "(";
    printShortestDouble(printer, getScale().convertToDouble());
    printer << ")";
  }
  printer << ">";
}

LogicalResult InitAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                               InitKind kind, APFloat scaleValue) {
  double scale = scaleValue.convertToDouble();
  if (!std::isfinite(scale))
    return emitError() << "initializer scale must be finite, got " << scale;
  if ((kind == InitKind::Normal || kind == InitKind::Uniform) && scale < 0)
    return emitError() << stringifyInitKind(kind)
                       << " initializer needs a non-negative scale, got " << scale;
  return success();
}

//===----------------------------------------------------------------------===//
// MeshAttr
//===----------------------------------------------------------------------===//

Attribute MeshAttr::parse(AsmParser &parser, Type) {
  SMLoc loc = parser.getCurrentLocation();
  SmallVector<StringAttr> names;
  SmallVector<int64_t> sizes;
  auto parseAxis = [&]() -> ParseResult {
    std::string name;
    int64_t size;
    if (parser.parseString(&name) || parser.parseEqual() || parser.parseInteger(size))
      return failure();
    names.push_back(StringAttr::get(parser.getContext(), name));
    sizes.push_back(size);
    return success();
  };
  if (parser.parseLess() ||
      parser.parseCommaSeparatedList(AsmParser::Delimiter::Square, parseAxis) ||
      parser.parseGreater())
    return {};
  return parser.getChecked<MeshAttr>(loc, parser.getContext(), names, sizes);
}

void MeshAttr::print(AsmPrinter &printer) const {
  printer << "<[";
  for (auto [i, name] : llvm::enumerate(getAxisNames())) {
    if (i)
      printer << ", ";
    printer << "\"" << name.getValue() << "\" = " << getAxisSizes()[i];
  }
  printer << "]>";
}

LogicalResult MeshAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                               ArrayRef<StringAttr> names, ArrayRef<int64_t> sizes) {
  if (names.size() != sizes.size())
    return emitError() << "mesh has " << names.size() << " axis names but "
                       << sizes.size() << " sizes";
  if (names.empty())
    return emitError() << "mesh needs at least one axis";
  llvm::StringSet<> seen;
  for (auto [name, size] : llvm::zip(names, sizes)) {
    if (name.getValue().empty())
      return emitError() << "mesh axis names must not be empty";
    if (!seen.insert(name.getValue()).second)
      return emitError() << "mesh axis \"" << name.getValue() << "\" appears twice";
    if (size < 1)
      return emitError() << "mesh axis \"" << name.getValue()
                         << "\" must have size >= 1, got " << size;
  }
  return success();
}

std::optional<int64_t> MeshAttr::getAxisSize(StringRef name) const {
  for (auto [axis, size] : llvm::zip(getAxisNames(), getAxisSizes()))
    if (axis.getValue() == name)
      return size;
  return std::nullopt;
}

int64_t MeshAttr::getNumDevices() const {
  int64_t n = 1;
  for (int64_t size : getAxisSizes())
    n *= size;
  return n;
}

//===----------------------------------------------------------------------===//
// ShardingAttr
//===----------------------------------------------------------------------===//

/// Parses `{"a", "b"}` into a list of axis names.
static ParseResult parseAxisSet(AsmParser &parser, SmallVectorImpl<Attribute> &axes) {
  return parser.parseCommaSeparatedList(AsmParser::Delimiter::Braces, [&]() -> ParseResult {
    std::string name;
    if (parser.parseString(&name))
      return failure();
    axes.push_back(StringAttr::get(parser.getContext(), name));
    return success();
  });
}

static void printAxisSet(AsmPrinter &printer, ArrayRef<Attribute> axes) {
  printer << "{";
  llvm::interleaveComma(axes, printer, [&](Attribute axis) {
    printer << "\"" << cast<StringAttr>(axis).getValue() << "\"";
  });
  printer << "}";
}

Attribute ShardingAttr::parse(AsmParser &parser, Type) {
  SMLoc loc = parser.getCurrentLocation();
  MLIRContext *ctx = parser.getContext();
  SmallVector<ArrayAttr> dims;
  SmallVector<StringAttr> partial;
  if (parser.parseLess() ||
      parser.parseCommaSeparatedList(AsmParser::Delimiter::Square, [&]() -> ParseResult {
        SmallVector<Attribute> axes;
        if (parseAxisSet(parser, axes))
          return failure();
        dims.push_back(ArrayAttr::get(ctx, axes));
        return success();
      }))
    return {};
  if (succeeded(parser.parseOptionalComma())) {
    SmallVector<Attribute> axes;
    if (parser.parseKeyword("partial") || parser.parseEqual() || parseAxisSet(parser, axes))
      return {};
    for (Attribute axis : axes)
      partial.push_back(llvm::cast<StringAttr>(axis));
  }
  if (parser.parseGreater())
    return {};
  return parser.getChecked<ShardingAttr>(loc, ctx, dims, partial);
}

void ShardingAttr::print(AsmPrinter &printer) const {
  printer << "<[";
  llvm::interleaveComma(getDims(), printer,
                        [&](ArrayAttr axes) { printAxisSet(printer, axes.getValue()); });
  printer << "]";
  if (!getPartialAxes().empty()) {
    SmallVector<Attribute> axes(getPartialAxes().begin(), getPartialAxes().end());
    printer << ", partial = ";
    printAxisSet(printer, axes);
  }
  printer << ">";
}

LogicalResult ShardingAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                                   ArrayRef<ArrayAttr> dims, ArrayRef<StringAttr> partial) {
  llvm::StringSet<> seen;
  auto use = [&](Attribute axis) -> LogicalResult {
    auto name = llvm::dyn_cast<StringAttr>(axis);
    if (!name)
      return emitError() << "sharding axes must be strings";
    if (!seen.insert(name.getValue()).second)
      return emitError() << "mesh axis \"" << name.getValue()
                         << "\" is used more than once in a sharding";
    return success();
  };
  for (ArrayAttr axes : dims)
    for (Attribute axis : axes)
      if (failed(use(axis)))
        return failure();
  for (StringAttr axis : partial)
    if (failed(use(axis)))
      return failure();
  return success();
}

LogicalResult ShardingAttr::verifyFor(MeshAttr mesh, RankedTensorType type,
                                      function_ref<InFlightDiagnostic()> emitError) const {
  if (static_cast<int64_t>(getDims().size()) != type.getRank())
    return emitError() << "sharding has " << getDims().size() << " dimensions but "
                       << type << " has rank " << type.getRank();
  auto axisSize = [&](Attribute axis) -> FailureOr<int64_t> {
    StringRef name = llvm::cast<StringAttr>(axis).getValue();
    std::optional<int64_t> size = mesh.getAxisSize(name);
    if (!size) {
      emitError() << "sharding uses axis \"" << name << "\", which mesh " << mesh
                  << " does not have";
      return failure();
    }
    return *size;
  };
  for (auto [dim, axes] : llvm::enumerate(getDims())) {
    int64_t parts = 1;
    for (Attribute axis : axes) {
      FailureOr<int64_t> size = axisSize(axis);
      if (failed(size))
        return failure();
      parts *= *size;
    }
    int64_t extent = type.getDimSize(dim);
    if (!ShapedType::isDynamic(extent) && extent % parts != 0)
      return emitError() << "dimension " << dim << " of " << type << " (size " << extent
                         << ") does not divide evenly into " << parts << " shards";
  }
  for (StringAttr axis : getPartialAxes())
    if (failed(axisSize(axis)))
      return failure();
  return success();
}
