// Llama-style decoder: 22 layers, hidden 2048, 32 heads (4 key/value heads), SwiGLU width 5632, sequence 2048, vocabulary 32000.
// Written by: loomc models llama --layers 22 --hidden 2048 --heads 32 --kv-heads 4 --ffn 5632 --seq 2048 --vocab 32000 --dtype f32
module attributes {loom.family = "llama"} {
  loom.param @embed : tensor<32000x2048xf32> init <normal(0.02)>
  loom.param @norm.g : tensor<2048xf32> init <ones>
  loom.param @lm_head : tensor<32000x2048xf32> init <normal(0.02)>

  // RMSNorm, rotary attention with grouped key/value heads, SwiGLU MLP.
  loom.block @layer(%x: tensor<?x2048x2048xf32>) -> tensor<?x2048x2048xf32> {
    loom.param @attn_norm.g : tensor<2048xf32> init <ones>
    loom.param @wq : tensor<2048x2048xf32> init <normal(0.02)>
    loom.param @wk : tensor<2048x256xf32> init <normal(0.02)>
    loom.param @wv : tensor<2048x256xf32> init <normal(0.02)>
    loom.param @wo : tensor<2048x2048xf32> init <normal(0.02)>
    loom.param @mlp_norm.g : tensor<2048xf32> init <ones>
    loom.param @w_gate : tensor<2048x5632xf32> init <normal(0.02)>
    loom.param @w_up : tensor<2048x5632xf32> init <normal(0.02)>
    loom.param @w_down : tensor<5632x2048xf32> init <normal(0.02)>

    %an = loom.get @attn_norm.g : tensor<2048xf32>
    %n1 = loom.rmsnorm %x, %an : tensor<?x2048x2048xf32>, tensor<2048xf32>
    %wq = loom.get @wq : tensor<2048x2048xf32>
    %wk = loom.get @wk : tensor<2048x256xf32>
    %wv = loom.get @wv : tensor<2048x256xf32>
    %q0 = loom.matmul %n1, %wq : tensor<?x2048x2048xf32>, tensor<2048x2048xf32>
    %k0 = loom.matmul %n1, %wk : tensor<?x2048x2048xf32>, tensor<2048x256xf32>
    %v = loom.matmul %n1, %wv : tensor<?x2048x2048xf32>, tensor<2048x256xf32>
    %q = loom.rotary %q0 {num_heads = 32} : tensor<?x2048x2048xf32>
    %k = loom.rotary %k0 {num_heads = 4} : tensor<?x2048x256xf32>
    %a = loom.attention %q, %k, %v {causal, num_heads = 32, num_kv_heads = 4} : tensor<?x2048x2048xf32>, tensor<?x2048x256xf32>, tensor<?x2048x256xf32>
    %wo = loom.get @wo : tensor<2048x2048xf32>
    %o = loom.matmul %a, %wo : tensor<?x2048x2048xf32>, tensor<2048x2048xf32>
    %r1 = loom.add %x, %o : tensor<?x2048x2048xf32>, tensor<?x2048x2048xf32>
    %mn = loom.get @mlp_norm.g : tensor<2048xf32>
    %n2 = loom.rmsnorm %r1, %mn : tensor<?x2048x2048xf32>, tensor<2048xf32>
    %wg = loom.get @w_gate : tensor<2048x5632xf32>
    %wu = loom.get @w_up : tensor<2048x5632xf32>
    %wd = loom.get @w_down : tensor<5632x2048xf32>
    %g0 = loom.matmul %n2, %wg : tensor<?x2048x2048xf32>, tensor<2048x5632xf32>
    %g = loom.silu %g0 : tensor<?x2048x5632xf32>
    %u = loom.matmul %n2, %wu : tensor<?x2048x2048xf32>, tensor<2048x5632xf32>
    %gu = loom.mul %g, %u : tensor<?x2048x5632xf32>, tensor<?x2048x5632xf32>
    %d = loom.matmul %gu, %wd : tensor<?x2048x5632xf32>, tensor<5632x2048xf32>
    %y = loom.add %r1, %d : tensor<?x2048x2048xf32>, tensor<?x2048x2048xf32>
    loom.yield %y : tensor<?x2048x2048xf32>
  }

  func.func @forward(%tokens: tensor<?x2048xi32>) -> tensor<?x2048x32000xf32> {
    %embed = loom.get @embed : tensor<32000x2048xf32>
    %x0 = loom.embedding %embed, %tokens : tensor<32000x2048xf32>, tensor<?x2048xi32>
    %x = loom.repeat 22 @layer(%x0) : (tensor<?x2048x2048xf32>) -> tensor<?x2048x2048xf32>
    %ng = loom.get @norm.g : tensor<2048xf32>
    %xf = loom.rmsnorm %x, %ng : tensor<?x2048x2048xf32>, tensor<2048xf32>
    %head = loom.get @lm_head : tensor<32000x2048xf32>
    %logits = loom.matmul %xf, %head {transpose_b} : tensor<?x2048x2048xf32>, tensor<32000x2048xf32>
    return %logits : tensor<?x2048x32000xf32>
  }

  func.func @loss(%tokens: tensor<?x2048xi32>, %targets: tensor<?x2048xi32>) -> tensor<f32> {
    %logits = call @forward(%tokens) : (tensor<?x2048xi32>) -> tensor<?x2048x32000xf32>
    %loss = loom.cross_entropy %logits, %targets : tensor<?x2048x32000xf32>, tensor<?x2048xi32>
    return %loss : tensor<f32>
  }
}
