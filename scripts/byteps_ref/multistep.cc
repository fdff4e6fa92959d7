// BytePS 0.2.5.post15's own chains run over several steps of a gradient stream: error feedback
// and nesterov momentum past the first step (where their state is no longer zero), and the
// server's recompression of the sum of two workers' pushes. Compiled by reference.py with the
// sdist's compressor sources and stubs/.
//
//   multistep N STEPS DIR   reads DIR/w0.<s>.f32 and DIR/w1.<s>.f32 (N float32 each, one file
//                           per step s), writes DIR/<case>.<s>.comp (the payload) and
//                           DIR/<case>.<s>.decomp (its decoding) for every case and step
//
// Worker cases compress worker 0's stream. Server cases run two worker chains (one per stream),
// then what BytePS's server engine does each round: Decompress each push with the server's
// compressor, copy the first into the store and sum the second onto it (CpuReducer), Compress
// the store with the server's chain; .comp is that reply and .decomp its decoding on a worker.
// Momentum is attached by hand (NesterovMomentumCompressor), as the worker build's registry
// does: this is the server build, whose registry leaves momentum out.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "compressor/compressor.h"
#include "compressor/compressor_registry.h"
#include "compressor/impl/nesterov_momentum.h"
#include "cpu_reducer.h"

using namespace byteps::common;
using namespace byteps::common::compressor;

namespace {

std::vector<char> ReadFile(const std::string& path, size_t bytes) {
  std::vector<char> b(bytes);
  FILE* f = fopen(path.c_str(), "rb");
  if (!f || fread(b.data(), 1, bytes, f) != bytes) { perror(path.c_str()); exit(1); }
  fclose(f);
  return b;
}

void WriteFile(const std::string& path, const void* data, size_t bytes) {
  FILE* f = fopen(path.c_str(), "wb");
  if (!f || fwrite(data, 1, bytes, f) != bytes) { perror(path.c_str()); exit(1); }
  fclose(f);
}

struct Case {
  std::string name;
  kwargs_t kwargs;   // BytePS's kwargs without momentum
  bool nesterov;     // workers wrap the chain in nesterov momentum (mu 0.9)
  bool server;       // two workers and the server's recompression
};

// The worker's chain: [nesterov ->] the registry's chain ([vanilla EF ->] codec).
std::unique_ptr<Compressor> WorkerChain(const Case& c, size_t aligned) {
  auto chain = CompressorRegistry::Create(c.kwargs, aligned, BYTEPS_FLOAT32);
  if (!c.nesterov) return chain;
  return std::unique_ptr<Compressor>(
      new NesterovMomentumCompressor(aligned, BYTEPS_FLOAT32, std::move(chain), 0.9f));
}

// A payload copied out of the compressor's buffer (the next call reuses that buffer).
std::vector<char> Compress(Compressor* chain, std::vector<float>& x, size_t bytes) {
  tensor_t g(reinterpret_cast<char*>(x.data()), bytes, BYTEPS_FLOAT32);
  auto c = chain->Compress(g);
  return std::vector<char>(c.data, c.data + c.size);
}

// Loads step s of a stream into a zero-padded buffer of the aligned size.
void Load(std::vector<float>& x, const std::string& path, size_t bytes) {
  auto in = ReadFile(path, bytes);
  std::memset(x.data(), 0, x.size() * sizeof(float));
  std::memcpy(x.data(), in.data(), bytes);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) { fprintf(stderr, "usage: %s N STEPS DIR\n", argv[0]); return 2; }
  size_t n = std::stoul(argv[1]);
  int steps = std::atoi(argv[2]);
  std::string dir = argv[3];
  {  // vanilla error feedback mmaps the learning rate from ./lr.s: a constant 0.1
    double lr = 0.1;
    WriteFile("lr.s", &lr, sizeof lr);
  }
  size_t bytes = n * sizeof(float), aligned = Align(bytes, BYTEPS_FLOAT32);
  std::string k1 = std::to_string(n / 100);  // 1%
  kwargs_t onebit_s = {{"compressor_type", "onebit"}, {"compressor_onebit_scaling", "true"}};
  kwargs_t onebit = {{"compressor_type", "onebit"}};
  kwargs_t topk = {{"compressor_type", "topk"}, {"compressor_k", k1}};
  kwargs_t randomk = {{"compressor_type", "randomk"}, {"compressor_k", k1}, {"seed", "2020"}};
  kwargs_t dith_nat = {{"compressor_type", "dithering"}, {"compressor_k", "2"}, {"seed", "2020"},
                       {"dithering_partition", "1"}, {"dithering_normalize", "0"}};
  kwargs_t dith_lin = {{"compressor_type", "dithering"}, {"compressor_k", "2"}, {"seed", "2020"},
                       {"dithering_partition", "0"}, {"dithering_normalize", "0"}};
  auto ef = [](kwargs_t kw) { kw["ef_type"] = "vanilla"; return kw; };
  std::vector<Case> cases = {
      {"ef_onebit_scaling", ef(onebit_s), false, false},
      {"ef_onebit", ef(onebit), false, false},
      {"ef_topk_1", ef(topk), false, false},
      {"ef_randomk_1", ef(randomk), false, false},
      {"ef_dithering_2_natural", ef(dith_nat), false, false},
      {"nesterov_ef_onebit_scaling", ef(onebit_s), true, false},
      {"nesterov_ef_topk_1", ef(topk), true, false},
      {"nesterov_onebit_scaling", onebit_s, true, false},
      {"randomk_1", randomk, false, false},
      {"dithering_2_linear", dith_lin, false, false},
      {"server_nesterov_ef_onebit_scaling", ef(onebit_s), true, true},
      {"server_onebit_scaling", onebit_s, false, true},
      {"server_ef_topk_1", ef(topk), false, true},
      {"server_ef_randomk_1", ef(randomk), false, true},
      {"server_ef_dithering_2_natural", ef(dith_nat), false, true},
  };
  CpuReducer reducer(nullptr);
  for (const auto& c : cases) {
    int workers = c.server ? 2 : 1;
    std::vector<std::unique_ptr<Compressor>> chains;
    for (int w = 0; w < workers; ++w) chains.push_back(WorkerChain(c, aligned));
    // The server's chain: the registry's, from the same kwargs (no momentum on a server).
    auto server = c.server ? CompressorRegistry::Create(c.kwargs, aligned, BYTEPS_FLOAT32) : nullptr;
    kwargs_t plain = c.kwargs;
    plain.erase("ef_type");
    auto decoder = CompressorRegistry::Create(plain, aligned, BYTEPS_FLOAT32);
    std::vector<float> x(aligned / sizeof(float)), store(aligned / sizeof(float));
    for (int s = 0; s < steps; ++s) {
      std::string stem = dir + "/" + c.name + "." + std::to_string(s);
      std::vector<char> payload;
      for (int w = 0; w < workers; ++w) {
        Load(x, dir + "/w" + std::to_string(w) + "." + std::to_string(s) + ".f32", bytes);
        payload = Compress(chains[w].get(), x, bytes);
        if (!c.server) break;
        tensor_t pushed(payload.data(), payload.size(), BYTEPS_FLOAT32);
        auto d = server->Decompress(pushed);
        if (w == 0) reducer.copy(store.data(), d.data, bytes);
        else reducer.sum(store.data(), d.data, bytes, BYTEPS_FLOAT32);
      }
      if (c.server) payload = Compress(server.get(), store, bytes);
      WriteFile(stem + ".comp", payload.data(), payload.size());
      tensor_t reply(payload.data(), payload.size(), BYTEPS_FLOAT32);
      auto d = decoder->Decompress(reply);
      WriteFile(stem + ".decomp", d.data, bytes);
    }
    printf("%s: %d steps\n", c.name.c_str(), steps);
  }
  return 0;
}
