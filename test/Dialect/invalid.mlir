// RUN: loom-opt %s -split-input-file -verify-diagnostics
// At least one invalid case per op; each error names the concrete shapes or attribute.

func.func @add_broadcast(%a: tensor<2x3xf32>, %b: tensor<4xf32>) {
  // expected-error @+1 {{'loom.add' op cannot broadcast 'tensor<2x3xf32>' with 'tensor<4xf32>'}}
  %0 = loom.add %a, %b : tensor<2x3xf32>, tensor<4xf32>
  return
}

// -----

func.func @sub_dtype(%a: tensor<3xf32>, %b: tensor<3xbf16>) {
  // expected-error @+1 {{'loom.sub' op operands have different element types: 'tensor<3xf32>' and 'tensor<3xbf16>'; insert loom.cast}}
  %0 = loom.sub %a, %b : tensor<3xf32>, tensor<3xbf16>
  return
}

// -----

func.func @mul_int(%a: tensor<3xi32>) {
  // expected-error @+1 {{'loom.mul' op operand #0 must be ranked tensor of 64-bit float or 32-bit float or bfloat16 type or 16-bit float values, but got 'tensor<3xi32>'}}
  %0 = loom.mul %a, %a : tensor<3xi32>, tensor<3xi32>
  return
}

// -----

func.func @div_broadcast(%a: tensor<2x3xf32>, %b: tensor<2x2xf32>) {
  // expected-error @+1 {{'loom.div' op cannot broadcast}}
  %0 = loom.div %a, %b : tensor<2x3xf32>, tensor<2x2xf32>
  return
}

// -----

func.func @unary_int(%a: tensor<3xi64>) {
  // expected-error @+1 {{'loom.gelu' op operand #0 must be ranked tensor of 64-bit float}}
  %0 = loom.gelu %a : tensor<3xi64>
  return
}

// -----

func.func @relu_unranked(%a: tensor<*xf32>) {
  // expected-error @+1 {{custom op 'loom.relu' invalid kind of type specified}}
  %0 = loom.relu %a : tensor<*xf32>
  return
}

// -----

func.func @silu_int(%a: tensor<3xi32>) {
  // expected-error @+1 {{'loom.silu' op operand #0 must be ranked tensor of 64-bit float}}
  %0 = loom.silu %a : tensor<3xi32>
  return
}

// -----

func.func @exp_int(%a: tensor<3xi32>) {
  // expected-error @+1 {{'loom.exp' op operand #0}}
  %0 = loom.exp %a : tensor<3xi32>
  return
}

// -----

func.func @tanh_int(%a: tensor<3xi32>) {
  // expected-error @+1 {{'loom.tanh' op operand #0}}
  %0 = loom.tanh %a : tensor<3xi32>
  return
}

// -----

func.func @rsqrt_int(%a: tensor<3xi32>) {
  // expected-error @+1 {{'loom.rsqrt' op operand #0}}
  %0 = loom.rsqrt %a : tensor<3xi32>
  return
}

// -----

func.func @neg_int(%a: tensor<3xi32>) {
  // expected-error @+1 {{'loom.neg' op operand #0}}
  %0 = loom.neg %a : tensor<3xi32>
  return
}

// -----

func.func @scale_missing(%a: tensor<3xf32>) {
  // expected-error @+1 {{'loom.scale' op requires attribute 'factor'}}
  %0 = loom.scale %a : tensor<3xf32>
  return
}

// -----

func.func @matmul_k(%a: tensor<2x8x768xf32>, %b: tensor<512x2304xf32>) {
  // expected-error @+1 {{'loom.matmul' op contraction dimensions differ: lhs 'tensor<2x8x768xf32>' has K = 768 but rhs 'tensor<512x2304xf32>' has K = 512}}
  %0 = loom.matmul %a, %b : tensor<2x8x768xf32>, tensor<512x2304xf32>
  return
}

// -----

func.func @matmul_rank(%a: tensor<8xf32>, %b: tensor<8x4xf32>) {
  // expected-error @+1 {{'loom.matmul' op operands need rank >= 2, got 'tensor<8xf32>' and 'tensor<8x4xf32>'}}
  %0 = loom.matmul %a, %b : tensor<8xf32>, tensor<8x4xf32>
  return
}

// -----

func.func @matmul_batch(%a: tensor<3x2x4xf32>, %b: tensor<5x4x2xf32>) {
  // expected-error @+1 {{'loom.matmul' op batch dimensions of 'tensor<3x2x4xf32>' and 'tensor<5x4x2xf32>' do not broadcast}}
  %0 = loom.matmul %a, %b : tensor<3x2x4xf32>, tensor<5x4x2xf32>
  return
}

// -----

func.func @reduce_axis(%a: tensor<2x3xf32>) {
  // expected-error @+1 {{'loom.reduce_sum' op axis 2 is out of range for 'tensor<2x3xf32>'}}
  %0 = loom.reduce_sum %a {axes = array<i64: 2>} : tensor<2x3xf32>
  return
}

// -----

func.func @reduce_twice(%a: tensor<2x3xf32>) {
  // expected-error @+1 {{'loom.reduce_max' op axis -1 is listed twice}}
  %0 = loom.reduce_max %a {axes = array<i64: 1, -1>} : tensor<2x3xf32>
  return
}

// -----

func.func @reduce_none(%a: tensor<2x3xf32>) {
  // expected-error @+1 {{'loom.reduce_mean' op needs at least one axis to reduce}}
  %0 = loom.reduce_mean %a {axes = array<i64>} : tensor<2x3xf32>
  return
}

// -----

func.func @softmax_axis(%a: tensor<2x3xf32>) {
  // expected-error @+1 {{'loom.softmax' op axis 5 is out of range for 'tensor<2x3xf32>'}}
  %0 = loom.softmax %a {axis = 5} : tensor<2x3xf32>
  return
}

// -----

func.func @layernorm_gamma(%x: tensor<2x8x64xf32>, %g: tensor<32xf32>) {
  // expected-error @+1 {{'loom.layernorm' op gamma must be 'tensor<64xf32>' to match input 'tensor<2x8x64xf32>', got 'tensor<32xf32>'}}
  %0 = loom.layernorm %x, %g, %g : tensor<2x8x64xf32>, tensor<32xf32>, tensor<32xf32>
  return
}

// -----

func.func @layernorm_eps(%x: tensor<2x64xf32>, %g: tensor<64xf32>) {
  // expected-error @+1 {{'loom.layernorm' op eps must be positive, got 0}}
  %0 = loom.layernorm %x, %g, %g {eps = 0.0 : f64} : tensor<2x64xf32>, tensor<64xf32>, tensor<64xf32>
  return
}

// -----

func.func @layernorm_negative_eps(%x: tensor<2x64xf32>, %g: tensor<64xf32>) {
  // expected-error @+1 {{'loom.layernorm' op eps must be positive, got -1.000000e-05}}
  %0 = loom.layernorm %x, %g, %g {eps = -1.0e-05 : f64} : tensor<2x64xf32>, tensor<64xf32>, tensor<64xf32>
  return
}

// -----

func.func @rmsnorm_infinite_eps(%x: tensor<2x64xf32>, %g: tensor<64xf32>) {
  // expected-error @+1 {{'loom.rmsnorm' op eps must be finite, got}}
  %0 = loom.rmsnorm %x, %g {eps = 0x7FF0000000000000 : f64} : tensor<2x64xf32>, tensor<64xf32>
  return
}

// -----

func.func @rmsnorm_dtype(%x: tensor<2x64xbf16>, %g: tensor<64xf32>) {
  // expected-error @+1 {{'loom.rmsnorm' op gamma has element type 'f32' but input 'tensor<2x64xbf16>' has 'bf16'}}
  %0 = loom.rmsnorm %x, %g : tensor<2x64xbf16>, tensor<64xf32>
  return
}

// -----

func.func @batchnorm_channels(%x: tensor<2x8x4x4xf32>, %g: tensor<4xf32>) {
  // expected-error @+1 {{'loom.batchnorm' op gamma must be 'tensor<8xf32>' to match input 'tensor<2x8x4x4xf32>', got 'tensor<4xf32>'}}
  %0 = loom.batchnorm %x, %g, %g : tensor<2x8x4x4xf32>, tensor<4xf32>, tensor<4xf32>
  return
}

// -----

func.func @embedding_table(%t: tensor<100xf32>, %ids: tensor<2x8xi32>) {
  // expected-error @+1 {{'loom.embedding' op table must be [vocab, hidden], got 'tensor<100xf32>'}}
  %0 = loom.embedding %t, %ids : tensor<100xf32>, tensor<2x8xi32>
  return
}

// -----

func.func @embedding_ids(%t: tensor<100x8xf32>, %ids: tensor<2x8xf32>) {
  // expected-error @+1 {{'loom.embedding' op operand #1 must be ranked tensor of 32-bit signless integer or 64-bit signless integer values}}
  %0 = loom.embedding %t, %ids : tensor<100x8xf32>, tensor<2x8xf32>
  return
}

// -----

func.func @rotary_heads(%x: tensor<2x8x60xf32>) {
  // expected-error @+1 {{'loom.rotary' op last dimension 60 of 'tensor<2x8x60xf32>' is not divisible by num_heads = 8}}
  %0 = loom.rotary %x {num_heads = 8} : tensor<2x8x60xf32>
  return
}

// -----

func.func @rotary_odd(%x: tensor<2x8x12xf32>) {
  // expected-error @+1 {{'loom.rotary' op head dimension 3 must be even to rotate pairs}}
  %0 = loom.rotary %x {num_heads = 4} : tensor<2x8x12xf32>
  return
}

// -----

func.func @attention_kv(%q: tensor<2x8x64xf32>, %k: tensor<2x8x32xf32>) {
  // expected-error @+1 {{'loom.attention' op k 'tensor<2x8x32xf32>' must have last dimension num_kv_heads * head_dim = 4 * 16 = 64}}
  %0 = loom.attention %q, %k, %k {num_heads = 4} : tensor<2x8x64xf32>, tensor<2x8x32xf32>, tensor<2x8x32xf32>
  return
}

// -----

func.func @attention_groups(%q: tensor<2x8x64xf32>) {
  // expected-error @+1 {{'loom.attention' op num_heads = 4 must be a multiple of num_kv_heads = 3}}
  %0 = loom.attention %q, %q, %q {num_heads = 4, num_kv_heads = 3} : tensor<2x8x64xf32>, tensor<2x8x64xf32>, tensor<2x8x64xf32>
  return
}

// -----

func.func @attention_missing_heads(%q: tensor<2x8x64xf32>) {
  // expected-error @+1 {{'loom.attention' op requires attribute 'num_heads'}}
  %0 = loom.attention %q, %q, %q : tensor<2x8x64xf32>, tensor<2x8x64xf32>, tensor<2x8x64xf32>
  return
}

// -----

func.func @cross_entropy_shape(%l: tensor<2x8x100xf32>, %t: tensor<2x7xi32>) {
  // expected-error @+1 {{'loom.cross_entropy' op targets 'tensor<2x7xi32>' must have the shape of logits 'tensor<2x8x100xf32>' without its last (class) dimension}}
  %0 = loom.cross_entropy %l, %t : tensor<2x8x100xf32>, tensor<2x7xi32>
  return
}

// -----

func.func @reshape_count(%x: tensor<2x3xf32>) {
  // expected-error @+1 {{'loom.reshape' op cannot reshape 'tensor<2x3xf32>' (6 elements) to 'tensor<7xf32>' (7 elements)}}
  %0 = loom.reshape %x : tensor<2x3xf32> -> tensor<7xf32>
  return
}

// -----

func.func @transpose_perm(%x: tensor<2x3x4xf32>) {
  // expected-error @+1 {{'loom.transpose' op permutation must list each dimension of 'tensor<2x3x4xf32>' exactly once}}
  %0 = loom.transpose %x {permutation = array<i64: 0, 0, 1>} : tensor<2x3x4xf32>
  return
}

// -----

func.func @slice_range(%x: tensor<2x10xf32>) {
  // expected-error @+1 {{'loom.slice' op range [8, 12) exceeds dimension 1 of 'tensor<2x10xf32>' (size 10)}}
  %0 = loom.slice %x {axis = 1, start = 8, size = 4} : tensor<2x10xf32>
  return
}

// -----

func.func @slice_missing(%x: tensor<2x10xf32>) {
  // expected-error @+1 {{'loom.slice' op requires attribute 'size'}}
  %0 = loom.slice %x {axis = 1, start = 8} : tensor<2x10xf32>
  return
}

// -----

func.func @concat_dims(%a: tensor<2x3xf32>, %b: tensor<4x3xf32>) {
  // expected-error @+1 {{'loom.concat' op input #1 'tensor<4x3xf32>' differs from input #0 'tensor<2x3xf32>' in dimension 0}}
  %0 = loom.concat %a, %b {axis = 1} : tensor<2x3xf32>, tensor<4x3xf32>
  return
}

// -----

func.func @broadcast_bad(%x: tensor<3x4xf32>) {
  // expected-error @+1 {{'loom.broadcast' op cannot broadcast 'tensor<3x4xf32>' to 'tensor<2x5x4xf32>'}}
  %0 = loom.broadcast %x : tensor<3x4xf32> -> tensor<2x5x4xf32>
  return
}

// -----

func.func @cast_shape(%x: tensor<3x4xf32>) {
  // expected-error @+1 {{'loom.cast' op cast changes only the element type, but 'tensor<3x4xf32>' and 'tensor<4x3xbf16>' differ in shape}}
  %0 = loom.cast %x : tensor<3x4xf32> -> tensor<4x3xbf16>
  return
}

// -----

func.func @conv_channels(%x: tensor<1x3x32x32xf32>, %w: tensor<8x4x3x3xf32>) {
  // expected-error @+1 {{'loom.conv2d' op input has 3 channels but filter 'tensor<8x4x3x3xf32>' with groups = 1 expects 4}}
  %0 = loom.conv2d %x, %w : tensor<1x3x32x32xf32>, tensor<8x4x3x3xf32>
  return
}

// -----

func.func @conv_fit(%x: tensor<1x3x2x2xf32>, %w: tensor<8x3x3x3xf32>) {
  // expected-error @+1 {{'loom.conv2d' op filter 'tensor<8x3x3x3xf32>' does not fit input 'tensor<1x3x2x2xf32>' with padding 0}}
  %0 = loom.conv2d %x, %w : tensor<1x3x2x2xf32>, tensor<8x3x3x3xf32>
  return
}

// -----

// NHWC: the channels are the last dimension of the input and the filter (OHWI).
func.func @conv_channels_nhwc(%x: tensor<1x32x32x3xf32>, %w: tensor<8x3x3x4xf32>) {
  // expected-error @+1 {{'loom.conv2d' op input has 3 channels but filter 'tensor<8x3x3x4xf32>' with groups = 1 expects 4}}
  %0 = loom.conv2d %x, %w {layout = "nhwc"} : tensor<1x32x32x3xf32>, tensor<8x3x3x4xf32>
  return
}

// -----

func.func @conv_layout(%x: tensor<1x3x8x8xf32>, %w: tensor<8x3x3x3xf32>) {
  // expected-error @+1 {{'loom.conv2d' op attribute 'layout' failed to satisfy constraint: image layout, "nchw" or "nhwc"}}
  %0 = loom.conv2d %x, %w {layout = "chwn"} : tensor<1x3x8x8xf32>, tensor<8x3x3x3xf32>
  return
}

// -----

func.func @batchnorm_nhwc(%x: tensor<2x4x4x8xf32>, %g: tensor<4xf32>) {
  // expected-error @+1 {{'loom.batchnorm' op gamma must be 'tensor<8xf32>' to match input 'tensor<2x4x4x8xf32>', got 'tensor<4xf32>'}}
  %0 = loom.batchnorm %x, %g, %g {layout = "nhwc"} : tensor<2x4x4x8xf32>, tensor<4xf32>, tensor<4xf32>
  return
}

// -----

func.func @maxpool_rank(%x: tensor<3x32x32xf32>) {
  // expected-error @+1 {{'loom.max_pool2d' op expects input [N, C, H, W], got 'tensor<3x32x32xf32>'}}
  %0 = loom.max_pool2d %x {kernel = 2} : tensor<3x32x32xf32>
  return
}

// -----

func.func @avgpool_kernel(%x: tensor<1x3x32x32xf32>) {
  // expected-error @+1 {{'loom.avg_pool2d' op needs kernel >= 1, stride >= 1 and 0 <= padding <= kernel/2, got 0, 1 and 0}}
  %0 = loom.avg_pool2d %x {kernel = 0} : tensor<1x3x32x32xf32>
  return
}

// -----

// expected-error @+1 {{'loom.param' op parameter @w needs a static shape, got 'tensor<?x4xf32>'}}
loom.param @w : tensor<?x4xf32> init <zeros>

// -----

// expected-error @+1 {{unknown initializer 'gaussian'; expected zeros, ones, normal(std), uniform(bound) or constant(value)}}
loom.param @w : tensor<4xf32> init <gaussian(1.0)>

// -----

// expected-error @+1 {{normal initializer needs a non-negative scale, got -1}}
loom.param @w : tensor<4xf32> init <normal(-1.0)>

// -----

loom.param @w : tensor<4xf32> init <zeros>
func.func @get_type() {
  // expected-error @+1 {{'loom.get' op reads @w as 'tensor<8xf32>' but it is declared as 'tensor<4xf32>'}}
  %0 = loom.get @w : tensor<8xf32>
  return
}

// -----

func.func @get_missing() {
  // expected-error @+1 {{'loom.get' op reads @nope, which is not a loom.param in this block or module}}
  %0 = loom.get @nope : tensor<8xf32>
  return
}

// -----

loom.block @grow(%x: tensor<2x4xf32>) -> tensor<2x8xf32> {
  %0 = loom.concat %x, %x {axis = 1} : tensor<2x4xf32>, tensor<2x4xf32>
  loom.yield %0 : tensor<2x8xf32>
}
func.func @repeat_shape(%x: tensor<2x4xf32>) {
  // expected-error @+1 {{'loom.repeat' op repeats @grow 3 times, but its result #0 ('tensor<2x8xf32>') does not match its argument ('tensor<2x4xf32>')}}
  %0 = loom.repeat 3 @grow(%x) : (tensor<2x4xf32>) -> tensor<2x8xf32>
  return
}

// -----

loom.block @step(%x: tensor<2x4xf32>) -> tensor<2x4xf32> {
  loom.yield %x : tensor<2x4xf32>
}
func.func @repeat_negative(%x: tensor<2x4xf32>) {
  // expected-error @+1 {{'loom.repeat' op count must be between 1 and 16384, got -1}}
  %0 = loom.repeat -1 @step(%x) : (tensor<2x4xf32>) -> tensor<2x4xf32>
  return
}

// -----

loom.block @step(%x: tensor<2x4xf32>) -> tensor<2x4xf32> {
  loom.yield %x : tensor<2x4xf32>
}
func.func @repeat_huge(%x: tensor<2x4xf32>) {
  // expected-error @+1 {{'loom.repeat' op count must be between 1 and 16384, got 9223372036854775807}}
  %0 = loom.repeat 9223372036854775807 @step(%x) : (tensor<2x4xf32>) -> tensor<2x4xf32>
  return
}

// -----

func.func @repeat_missing(%x: tensor<2x4xf32>) {
  // expected-error @+1 {{'loom.repeat' op @nothing is not a loom.block of this module}}
  %0 = loom.repeat 2 @nothing(%x) : (tensor<2x4xf32>) -> tensor<2x4xf32>
  return
}

// -----

loom.block @id(%x: tensor<2x4xf32>) -> tensor<2x4xf32> {
  %0 = loom.transpose %x {permutation = array<i64: 1, 0>} : tensor<2x4xf32>
  // expected-error @+1 {{'loom.yield' op value #0 has type 'tensor<4x2xf32>' but @id returns 'tensor<2x4xf32>'}}
  loom.yield %0 : tensor<4x2xf32>
}

// -----

// expected-error @+1 {{mesh axis "tp" appears twice}}
module attributes {loom.mesh = #loom.mesh<["tp" = 2, "tp" = 4]>} {}

// -----

// expected-error @+1 {{mesh axis "dp" must have size >= 1, got 0}}
module attributes {loom.mesh = #loom.mesh<["dp" = 0]>} {}

// -----

module attributes {loom.mesh = #loom.mesh<["dp" = 2, "tp" = 4]>} {
  // expected-error @+1 {{dimension 0 of 'tensor<6xf32>' (size 6) does not divide evenly into 4 shards}}
  loom.param @b : tensor<6xf32> init <zeros> {loom.sharding = #loom.sharding<[{"tp"}]>}
}

// -----

module attributes {loom.mesh = #loom.mesh<["dp" = 2]>} {
  // expected-error @+1 {{sharding uses axis "tp", which mesh #loom.mesh<["dp" = 2]> does not have}}
  loom.param @b : tensor<8xf32> init <zeros> {loom.sharding = #loom.sharding<[{"tp"}]>}
}

// -----

module attributes {loom.mesh = #loom.mesh<["dp" = 2, "tp" = 2]>} {
  // expected-error @+1 {{mesh axis "tp" is used more than once in a sharding}}
  loom.param @b : tensor<8x8xf32> init <zeros> {loom.sharding = #loom.sharding<[{"tp"}, {"tp"}]>}
}

// -----

// expected-error @+1 {{'loom.sharding' needs a 'loom.mesh' attribute on the enclosing module}}
loom.param @b : tensor<8xf32> init <zeros> {loom.sharding = #loom.sharding<[{"tp"}]>}

// -----

// expected-error @+1 {{'loom.block' op arguments must be ranked tensors, got 'i32'}}
loom.block @scalar(%x: i32) -> i32 {
  loom.yield %x : i32
}

// -----

func.func @yield_outside() {
  // expected-error @+1 {{'loom.yield' op expects parent op 'loom.block'}}
  loom.yield
}

// -----

func.func @bad_reduction(%x: tensor<4xf32>) -> tensor<4xf32> {
  // expected-error @+1 {{'loom.all_reduce' op reduction must be "sum", "mean" or "max", got "prod"}}
  %0 = loom.all_reduce %x {group = "tp", reduction = "prod"} : tensor<4xf32>
  return %0 : tensor<4xf32>
}

// -----

func.func @no_group(%x: tensor<4xf32>) -> tensor<4xf32> {
  // expected-error @+1 {{'loom.all_reduce' op needs a group (a mesh axis such as "tp")}}
  %0 = loom.all_reduce %x {group = ""} : tensor<4xf32>
  return %0 : tensor<4xf32>
}

// -----

func.func @grad_all_reduce_types(%x: tensor<4xf32>) -> tensor<8xf32> {
  // expected-error @+1 {{'loom.grad_all_reduce' op failed to verify that all of {x, result} have same type}}
  %0 = "loom.grad_all_reduce"(%x) {group = "tp"} : (tensor<4xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

func.func @gather_axis(%x: tensor<2x8xf32>) {
  // expected-error @+1 {{'loom.all_gather' op axis 2 is out of range}}
  %0 = loom.all_gather %x {axis = 2 : i64, group = "tp", parts = 2 : i64} : tensor<2x8xf32>
  return
}

// -----

func.func @gather_parts(%x: tensor<2x8xf32>) {
  // expected-error @+1 {{'loom.all_gather' op needs parts >= 1, got 0}}
  %0 = loom.all_gather %x {axis = 1 : i64, group = "tp", parts = 0 : i64} : tensor<2x8xf32>
  return
}

