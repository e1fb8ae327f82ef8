// Llama-style decoder: 2 layers, hidden 64, 4 heads (2 key/value heads), SwiGLU width 176, sequence 32, vocabulary 256.
// Written by: loomc models llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --ffn 176 --seq 32 --vocab 256 --dtype f32
module attributes {loom.family = "llama"} {
  loom.param @embed : tensor<256x64xf32> init <normal(0.02)>
  loom.param @norm.g : tensor<64xf32> init <ones>
  loom.param @lm_head : tensor<256x64xf32> init <normal(0.02)>

  // RMSNorm, rotary attention with grouped key/value heads, SwiGLU MLP.
  loom.block @layer(%x: tensor<?x32x64xf32>) -> tensor<?x32x64xf32> {
    loom.param @attn_norm.g : tensor<64xf32> init <ones>
    loom.param @wq : tensor<64x64xf32> init <normal(0.02)>
    loom.param @wk : tensor<64x32xf32> init <normal(0.02)>
    loom.param @wv : tensor<64x32xf32> init <normal(0.02)>
    loom.param @wo : tensor<64x64xf32> init <normal(0.02)>
    loom.param @mlp_norm.g : tensor<64xf32> init <ones>
    loom.param @w_gate : tensor<64x176xf32> init <normal(0.02)>
    loom.param @w_up : tensor<64x176xf32> init <normal(0.02)>
    loom.param @w_down : tensor<176x64xf32> init <normal(0.02)>

    %an = loom.get @attn_norm.g : tensor<64xf32>
    %n1 = loom.rmsnorm %x, %an : tensor<?x32x64xf32>, tensor<64xf32>
    %wq = loom.get @wq : tensor<64x64xf32>
    %wk = loom.get @wk : tensor<64x32xf32>
    %wv = loom.get @wv : tensor<64x32xf32>
    %q0 = loom.matmul %n1, %wq : tensor<?x32x64xf32>, tensor<64x64xf32>
    %k0 = loom.matmul %n1, %wk : tensor<?x32x64xf32>, tensor<64x32xf32>
    %v = loom.matmul %n1, %wv : tensor<?x32x64xf32>, tensor<64x32xf32>
    %q = loom.rotary %q0 {num_heads = 4} : tensor<?x32x64xf32>
    %k = loom.rotary %k0 {num_heads = 2} : tensor<?x32x32xf32>
    %a = loom.attention %q, %k, %v {causal, num_heads = 4, num_kv_heads = 2} : tensor<?x32x64xf32>, tensor<?x32x32xf32>, tensor<?x32x32xf32>
    %wo = loom.get @wo : tensor<64x64xf32>
    %o = loom.matmul %a, %wo : tensor<?x32x64xf32>, tensor<64x64xf32>
    %r1 = loom.add %x, %o : tensor<?x32x64xf32>, tensor<?x32x64xf32>
    %mn = loom.get @mlp_norm.g : tensor<64xf32>
    %n2 = loom.rmsnorm %r1, %mn : tensor<?x32x64xf32>, tensor<64xf32>
    %wg = loom.get @w_gate : tensor<64x176xf32>
    %wu = loom.get @w_up : tensor<64x176xf32>
    %wd = loom.get @w_down : tensor<176x64xf32>
    %g0 = loom.matmul %n2, %wg : tensor<?x32x64xf32>, tensor<64x176xf32>
    %g = loom.silu %g0 : tensor<?x32x176xf32>
    %u = loom.matmul %n2, %wu : tensor<?x32x64xf32>, tensor<64x176xf32>
    %gu = loom.mul %g, %u : tensor<?x32x176xf32>, tensor<?x32x176xf32>
    %d = loom.matmul %gu, %wd : tensor<?x32x176xf32>, tensor<176x64xf32>
    %y = loom.add %r1, %d : tensor<?x32x64xf32>, tensor<?x32x64xf32>
    loom.yield %y : tensor<?x32x64xf32>
  }

  func.func @forward(%tokens: tensor<?x32xi32>) -> tensor<?x32x256xf32> {
    %embed = loom.get @embed : tensor<256x64xf32>
    %x0 = loom.embedding %embed, %tokens : tensor<256x64xf32>, tensor<?x32xi32>
    %x = loom.repeat 2 @layer(%x0) : (tensor<?x32x64xf32>) -> tensor<?x32x64xf32>
    %ng = loom.get @norm.g : tensor<64xf32>
    %xf = loom.rmsnorm %x, %ng : tensor<?x32x64xf32>, tensor<64xf32>
    %head = loom.get @lm_head : tensor<256x64xf32>
    %logits = loom.matmul %xf, %head {transpose_b} : tensor<?x32x64xf32>, tensor<256x64xf32>
    return %logits : tensor<?x32x256xf32>
  }

  func.func @loss(%tokens: tensor<?x32xi32>, %targets: tensor<?x32xi32>) -> tensor<f32> {
    %logits = call @forward(%tokens) : (tensor<?x32xi32>) -> tensor<?x32x256xf32>
    %loss = loom.cross_entropy %logits, %targets : tensor<?x32x256xf32>, tensor<?x32xi32>
    return %loss : tensor<f32>
  }
}
