// fulcrum_train as a user meets it: bad input exits 2 with one clear message before any
// work; recipes and flags combine; a run that exits and resumes reproduces the straight
// run exactly (the "done when" check, through the real binary).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/data/indexed_dataset.h"
#include "core/device.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

const std::string kTrain = std::string(FULCRUM_BIN_DIR) + "/fulcrum_train";

struct BadInputCase {
  std::string name;
  std::string flags;
  std::string expected_message;
};

void PrintTo(const BadInputCase& c, std::ostream* os) { *os << c.flags; }

class BadInputTest : public ::testing::TestWithParam<BadInputCase> {};

TEST_P(BadInputTest, ExitsTwoWithAClearMessage) {
  if (GetParam().flags == "--device=cuda" && VisibleCudaDevices() > 0)
    GTEST_SKIP() << "a GPU is visible: --device=cuda is not bad input here";
  std::string output;
  const int code = testing::RunCommand(kTrain + " " + GetParam().flags, &output);
  EXPECT_EQ(code, 2) << output;
  EXPECT_NE(output.find(GetParam().expected_message), std::string::npos) << output;
  EXPECT_EQ(output.find("iteration "), std::string::npos) << "no training may start: " << output;
}

INSTANTIATE_TEST_SUITE_P(
    Flags, BadInputTest,
    ::testing::Values(
        BadInputCase{"HeadsDoNotDivideHidden", "--recipe=tiny --hidden_size=30 --num_attention_heads=4",
                     "--hidden_size=30 is not divisible by --num_attention_heads=4"},
        BadInputCase{"GlobalBatchNotMultiple", "--global_batch_size=10 --micro_batch_size=4",
                     "--global_batch_size=10 is not a multiple of --micro_batch_size=4"},
        BadInputCase{"UnknownRecipe", "--recipe=nope", "--recipe='nope' is unknown; recipes: gpt_20m, llama2_7b"},
        BadInputCase{"UnknownNormalization", "--normalization=BatchNorm",
                     "--normalization='BatchNorm' is unknown; use LayerNorm or RMSNorm"},
        BadInputCase{"QueryGroupsWithoutGroupedAttention", "--num_query_groups=2",
                     "--num_query_groups needs --group_query_attention"},
        BadInputCase{"QueryGroupsDoNotDivideHeads", "--group_query_attention --num_query_groups=3",
                     "--num_query_groups=3 must divide --num_attention_heads=4"},
        BadInputCase{"SwigluWithOpenaiGelu", "--swiglu --openai_gelu",
                     "--openai_gelu and --swiglu exclude each other"},
        BadInputCase{"MissingDataPath", "--data_path=/nonexistent/corpus", "/nonexistent/corpus"},
        BadInputCase{"UnknownDecayStyle", "--lr_decay_style=exponential", "--lr_decay_style='exponential' is unknown"},
        BadInputCase{"UnknownPositionEmbedding", "--position_embedding_type=alibi", "--position_embedding_type='alibi'"},
        BadInputCase{"ZeroTrainIters", "--train_iters=0", "--train_iters=0 must be"},
        BadInputCase{"NegativeLr", "--lr=-1", "--lr=-1 must be > 0"},
        BadInputCase{"MinLrAboveLr", "--min_lr=1 --lr=0.1", "--min_lr=1 must be in"},
        BadInputCase{"DropoutOutOfRange", "--hidden_dropout=1.5", "--hidden_dropout=1.5 must be in [0, 1)"},
        BadInputCase{"SaveIntervalWithoutSave", "--save_interval=5", "--save_interval=5 needs --save"},
        BadInputCase{"MissingCheckpoint", "--load=/nonexistent/ckpt", "/nonexistent/ckpt"},
        BadInputCase{"VocabSizeBelowTheEmbeddedCorpus", "--vocab_size=100",
                     "--vocab_size=100 is below the embedded corpus's 257 byte tokens"},
        BadInputCase{"TokenizerWithoutData", "--tokenizer_model=m.model", "--tokenizer_model needs --data_path"},
        BadInputCase{"StrayArgument", "stray_argument", "unexpected argument 'stray_argument'"},
        BadInputCase{"TpDoesNotDivideWorld", "--tensor_model_parallel_size=2",
                     "world size 1 is not divisible by --tensor_model_parallel_size=2"},
        BadInputCase{"UnknownBackend", "--distributed_backend=mpi", "mpi"},
        BadInputCase{"NegativeThreads", "--num_threads=-1", "--num_threads=-1 must be ≥ 0"},
        // Checked at pp=1 too, where no schedule runs.
        BadInputCase{"UnknownScheduleAtOneStage", "--pipeline_schedule=bogus",
                     "--pipeline_schedule='bogus' is unknown; schedules: 1f1b"},
        // Refused while the model is built: one line and exit 2, not an abort.
        BadInputCase{"PluginOrderThatCannotCompose", "--plugins=early_exit,mod",
                     "mod cannot route layer"},
        BadInputCase{"FlagOfAPluginNotSelected", "--prune_final_sparsity=1.5",
                     "--prune_final_sparsity=1.5 is a flag of the 'prune' plugin, which is not "
                     "selected"},
        BadInputCase{"NoMoeLayerInThePattern", "--recipe=tiny_moe --moe_layer_freq=[0,0,0,0]",
                     "--moe_layer_freq=[0,0,0,0] makes no layer an MoE layer"},
        // Parse errors: one line naming the flag, exit 2 (gflags alone would exit 1).
        BadInputCase{"NonNumericValue", "--lr=abc", "--lr='abc' is not a valid number"},
        BadInputCase{"UnknownFlag", "--no_such_flag", "unknown flag --no_such_flag"},
        BadInputCase{"MisspeltFlag", "--num_layerz=3", "did you mean --num_layers?"},
        BadInputCase{"OutOfRange", "--tensor_model_parallel_size=99999999999",
                     "--tensor_model_parallel_size='99999999999' is not a valid integer"},
        BadInputCase{"MissingValue", "--lr", "--lr needs a value"},
        BadInputCase{"MissingFlagfile", "--flagfile=/nonexistent/flags",
                     "--flagfile=/nonexistent/flags: cannot read that file"},
        // The right flag is blamed.
        BadInputCase{"ZeroLayers", "--num_layers=0", "--num_layers=0 must be ≥ 1"},
        BadInputCase{"UnwritableSave", "--save=/proc/fulcrum_no_such_dir",
                     "cannot save checkpoints to /proc/fulcrum_no_such_dir (--save)"},
        BadInputCase{"KeepLastWithoutSave", "--save_keep_last=2", "--save_keep_last=2 needs --save"},
        BadInputCase{"UnknownCkptFormat", "--ckpt_format=torch_dist",
                     "--ckpt_format='torch_dist' is not a checkpoint format; expected sharded or full"},
        BadInputCase{"UnknownParamsDtype", "--params_dtype=fp16", "--params_dtype='fp16' is unknown"},
        // The device seam (core/device.h): refused before any work, naming the flag. This
        // machine's tests run where no GPU is visible, so cuda is refused with the count.
        BadInputCase{"CudaWithoutAGpu", "--device=cuda",
                     "--device=cuda needs GPU 0 (LOCAL_RANK 0) but this process sees 0 GPUs "
                     "(use --device=cpu or auto)"},
        BadInputCase{"UnknownDevice", "--device=tpu",
                     "--device='tpu' is unknown; expected cpu, cuda, cuda:N or auto"},
        BadInputCase{"Bf16OverFp64", "--bf16 --params_dtype=fp64",
                     "--bf16 computes over fp32 master weights; it excludes --params_dtype=fp64"},
        BadInputCase{"Bf16ParamsDtype", "--params_dtype=bf16", "bf16 compute over fp32 masters is --bf16"},
        // Every built-in plugin runs under --bf16 (tests/recipes/bf16_plugins_train_test.cc);
        // one without the capability is refused by name (PluginApiTest.
        // Bf16RefusesAPluginThatDoesNotDeclareIt).
        // Outputs are checked before any work, each error naming its own flag.
        BadInputCase{"UnwritableMetricsFile",
                     "--recipe=tiny --train_iters=2 --metrics_file=/proc/fulcrum_no_such_dir/m.jsonl",
                     "--metrics_file=/proc/fulcrum_no_such_dir/m.jsonl cannot be written"},
        BadInputCase{"UnwritableLoadTrace",
                     "--recipe=tiny --train_iters=2 --load_trace=/proc/fulcrum_no_such_dir/t.jsonl",
                     "--load_trace=/proc/fulcrum_no_such_dir/t.jsonl cannot be written"},
        // Re-packing merges pipeline stages; one stage has none to merge.
        BadInputCase{"RepackScriptAtOneStage", "--recipe=tiny --train_iters=3 --repack_script=2:1",
                     "--repack_script: step 2:1 cannot happen"},
        BadInputCase{"RepackAutoAtOneStage", "--recipe=tiny --train_iters=3 --repack=auto",
                     "--repack=auto merges pipeline stages onto fewer ranks"}),
    [](const ::testing::TestParamInfo<BadInputCase>& info) { return info.param.name; });

std::vector<nlohmann::json> ReadMetrics(const std::string& path) {
  std::vector<nlohmann::json> records;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) records.push_back(nlohmann::json::parse(line));
  return records;
}

// --device=auto resolves to cpu on a machine without a GPU and says so once at the start;
// --bf16 runs and says so too, and the manifest records both.
TEST(TrainCliTest, DeviceAutoIsCpuHereAndLoggedOnce) {
  if (VisibleCudaDevices() > 0) GTEST_SKIP() << "a GPU is visible: auto would pick it";
  const std::string dir = testing::MakeTempDir("cli_device");
  std::string output;
  ASSERT_EQ(testing::RunCommand(kTrain + " --recipe=tiny --num_layers=2 --train_iters=2 "
                                         "--eval_interval=0 --log_interval=1",
                                &output),
            0)
      << output;
  const size_t at = output.find("device: cpu fp32 (--device=auto)");
  EXPECT_NE(at, std::string::npos) << output;
  EXPECT_EQ(output.find("device: ", at + 1), std::string::npos) << "logged once\n" << output;
  ASSERT_EQ(testing::RunCommand(kTrain + " --recipe=tiny --num_layers=2 --train_iters=2 "
                                         "--eval_interval=0 --log_interval=1 --device=cpu --bf16"
                                         " --save=" + dir + "/ckpt",
                                &output),
            0)
      << output;
  EXPECT_NE(output.find("device: cpu bf16/fp32 (--device=cpu, --bf16)"), std::string::npos)
      << output;
  std::ifstream in(dir + "/ckpt/iter_0000002/manifest.json");
  ASSERT_TRUE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json manifest = nlohmann::json::parse(text.str());
  EXPECT_EQ(manifest["config"]["device"]["compute_dtype"], "bf16") << manifest["config"];
  EXPECT_EQ(manifest["config"]["device"]["master_dtype"], "fp32");
  EXPECT_EQ(manifest["config"]["model"]["params_dtype"], "fp32");
}

// Short runs of the tiny recipe: 8 straight vs 4 + exit + resume 4.
TEST(TrainCliTest, ExitAndResumeReproduceTheStraightRun) {
  const std::string dir = testing::MakeTempDir("cli_resume");
  const std::string common = kTrain +
                             " --recipe=tiny --num_layers=2 --train_iters=8 --eval_interval=0"
                             " --log_interval=2";
  std::string output;
  ASSERT_EQ(testing::RunCommand(common + " --metrics_file=" + dir + "/straight.jsonl", &output), 0)
      << output;
  EXPECT_NE(output.find("loss"), std::string::npos);
  ASSERT_EQ(testing::RunCommand(common + " --save=" + dir + "/ckpt --save_interval=4"
                                " --exit_interval=4 --metrics_file=" + dir + "/first.jsonl",
                                &output),
            0)
      << output;
  EXPECT_NE(output.find("exiting at iteration 4"), std::string::npos) << output;
  ASSERT_EQ(testing::RunCommand(common + " --load=" + dir + "/ckpt --metrics_file=" + dir +
                                    "/resumed.jsonl",
                                &output),
            0)
      << output;

  auto straight = ReadMetrics(dir + "/straight.jsonl");
  auto first = ReadMetrics(dir + "/first.jsonl");
  auto resumed = ReadMetrics(dir + "/resumed.jsonl");
  ASSERT_EQ(straight.size(), 8u);
  ASSERT_EQ(first.size(), 4u);
  ASSERT_EQ(resumed.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(first[i]["loss"].get<double>(), straight[i]["loss"].get<double>()) << i;
    EXPECT_EQ(resumed[i]["iteration"].get<int>(), i + 5);
    EXPECT_EQ(resumed[i]["loss"].get<double>(), straight[i + 4]["loss"].get<double>()) << i + 5;
    EXPECT_EQ(resumed[i]["lr"].get<double>(), straight[i + 4]["lr"].get<double>());
  }
  for (const char* key : {"iteration", "loss", "lr", "grad_norm", "tokens_per_second",
                          "iteration_ms"}) {
    EXPECT_TRUE(straight[0].contains(key)) << key;
  }
}

TEST(TrainCliTest, ExplicitFlagsOverrideTheRecipeAndFlagfilesWork) {
  const std::string dir = testing::MakeTempDir("cli_flagfile");
  {
    std::ofstream flagfile(dir + "/flags");
    flagfile << "--recipe=tiny\n--num_layers=1\n--train_iters=2\n--eval_interval=0\n";
  }
  std::string output;
  // Two threads with no wait policy set: fulcrum_train leaves it unset (NOTE [OpenMP wait
  // policy] in core/threads.h) and says so.
  ASSERT_EQ(testing::RunCommand("env -u OMP_WAIT_POLICY " + kTrain + " --flagfile=" + dir +
                                "/flags --hidden_size=64"
                                " --num_threads=2 --metrics_file=" + dir + "/m.jsonl",
                                &output),
            0)
      << output;
  auto records = ReadMetrics(dir + "/m.jsonl");
  EXPECT_EQ(records.size(), 2u) << "--train_iters from the flagfile beats the recipe's";
  EXPECT_NE(output.find("compute threads per process: 2 (--num_threads; LibTorch 2, "
                       "OMP_WAIT_POLICY unset)"), std::string::npos)
      << output;
  // 1 layer of width 64 (flag beats the recipe's 128; MLP 4 x 64): parameter count in the log.
  EXPECT_NE(output.find("training 82880 parameters"), std::string::npos) << output;
}

TEST(TrainCliTest, ParseErrorsPrintOneLine) {
  for (const char* flags : {"--lr=abc", "--no_such_flag", "--flagfile=/nonexistent/flags"}) {
    std::string output;
    EXPECT_EQ(testing::RunCommand(kTrain + " " + flags, &output), 2) << output;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
    EXPECT_EQ(output.rfind("fulcrum_train: ", 0), 0u) << output;
  }
  // A bad line inside a flag file names the file and the line.
  const std::string dir = testing::MakeTempDir("cli_bad_flagfile");
  {
    std::ofstream flagfile(dir + "/flags");
    flagfile << "# comment\n--num_layers=2\n--lr=fast\n";
  }
  std::string output;
  EXPECT_EQ(testing::RunCommand(kTrain + " --flagfile=" + dir + "/flags", &output), 2);
  EXPECT_NE(output.find("--lr='fast' is not a valid number (in " + dir + "/flags:3)"),
            std::string::npos)
      << output;
}

// Flag-file lines that gflags rejects by exiting 1 with its own message (or printing its
// own help) after our checks had passed them; found by tests/fuzz/flagfile_fuzz.cc's
// "fuzz target exited". Each is now refused before gflags parses: one line, exit 2.
TEST(TrainCliTest, FlagfileLinesGflagsWouldRejectAreRefusedFirst) {
  const std::string dir = testing::MakeTempDir("cli_flagfile_gflags");
  struct Case {
    std::string contents;
    std::string expected;
  };
  const std::vector<Case> cases = {
      // gflags parses the value up to the line end; we used to strip the space.
      {"--lr=0.1 \n", "--lr='0.1 ' is not a valid number (in " + dir + "/flags:1)"},
      // gflags prints its own help and exits 1.
      {"# comment\n--help\n", "--help asks for help, which only the command line can (in " +
                                   dir + "/flags:2)"},
      {"--helpon=cli\n", "--helpon is gflags' own help, not offered here"},
      // gflags exits when $FLAGS_<name> is unset, or the name unknown.
      {"--fromenv=lr\n", "--fromenv=lr: $FLAGS_lr is not set"},
      {"--tryfromenv=no_such_flag\n", "--tryfromenv names an unknown flag --no_such_flag"},
      // gflags' list parser exits on an empty entry.
      {"--flagfile=" + dir + "/flags,,x\n", "has an entry ''"},
      // ... and so does the list in --undefok, read after parsing (tests/fuzz, 2026-11-26).
      {"-undefok=-=4\n", "--undefok='-=4' has an entry '-=4'; expected a comma-separated list"},
      {"--undefok=lr,,x\n", "--undefok='lr,,x' has an entry ''"},
      // gflags prints shell completions and exits 0.
      {"--tab_completion_word=lr\n", "--tab_completion_word is gflags' own help"},
      // Lines end at '\r' when there is one, as in gflags; line numbers still count '\n'.
      {"--num_layers=1\r\n\n--lr=x\r\n", "--lr='x' is not a valid number (in " + dir + "/flags:3)"},
  };
  for (const Case& c : cases) {
    {
      std::ofstream flagfile(dir + "/flags", std::ios::binary | std::ios::trunc);
      flagfile << c.contents;
    }
    std::string output;
    EXPECT_EQ(testing::RunCommand("env -u FLAGS_lr " + kTrain + " --flagfile=" + dir + "/flags",
                                  &output),
              2)
        << c.contents << output;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
    EXPECT_NE(output.find(c.expected), std::string::npos) << c.contents << output;
  }
  // --tryfromenv with the variable set checks its value like any other.
  std::string output;
  EXPECT_EQ(testing::RunCommand("FLAGS_lr=fast " + kTrain + " --tryfromenv=lr", &output), 2)
      << output;
  EXPECT_NE(output.find("--lr='fast' is not a valid number (from $FLAGS_lr)"), std::string::npos)
      << output;
}

TEST(TrainCliTest, HelpShowsFulcrumsFlagsInGroupsAndExitsZero) {
  std::string output;
  ASSERT_EQ(testing::RunCommand(kTrain + " --help", &output), 0) << output;
  EXPECT_EQ(output.rfind("fulcrum_train: trains a GPT model", 0), 0u) << "Fulcrum's lines first";
  EXPECT_NE(output.find("tiny"), std::string::npos);
  EXPECT_NE(output.find("gpt_20m"), std::string::npos);
  size_t last = 0;
  for (const char* group : {"\nModel:\n", "\nTraining:\n", "\nData:\n", "\nParallel:\n",
                            "\nPipeline and balancing:\n", "\nMoE:\n", "\nCheckpoints:\n",
                            "\nLogging:\n"}) {
    const size_t at = output.find(group);
    ASSERT_NE(at, std::string::npos) << group << " missing:\n" << output;
    EXPECT_GT(at, last) << group << " out of order";
    last = at;
  }
  EXPECT_EQ(output.find("\nOther:\n"), std::string::npos) << "every flag belongs to a group";
  for (const char* flag : {"--data_path=", "--save_keep_last=", "--params_dtype=", "--timeline="}) {
    EXPECT_NE(output.find(flag), std::string::npos) << flag;
  }
  // LibTorch's, glog's and gflags' own flags only under --helpfull.
  for (const char* library_flag : {"--logtostderr", "--caffe2", "--minloglevel", "--v="}) {
    EXPECT_EQ(output.find(library_flag), std::string::npos) << library_flag;
  }
  std::string full;
  ASSERT_EQ(testing::RunCommand(kTrain + " --helpfull", &full), 0);
  EXPECT_NE(full.find("logtostderr"), std::string::npos);
  EXPECT_LT(std::count(output.begin(), output.end(), '\n'),
            std::count(full.begin(), full.end(), '\n'));
}

// NOTE [manifest checksum]: a checkpoint made to look like format 1 (no checksum) with an
// edited data position is refused by --load before any work, naming the flag that would
// accept it; with the flag it resumes, from the edited position.
TEST(TrainCliTest, LoadRefusesAManifestWithoutChecksumUnlessAllowed) {
  const std::string dir = testing::MakeTempDir("cli_format1");
  const std::string common = kTrain + " --recipe=tiny --num_layers=2 --eval_interval=0 --log_interval=1";
  std::string output;
  ASSERT_EQ(testing::RunCommand(common + " --train_iters=2 --save=" + dir + "/ckpt", &output), 0)
      << output;
  const std::string manifest_path = dir + "/ckpt/iter_0000002/manifest.json";
  nlohmann::json manifest;
  {
    std::ifstream in(manifest_path);
    manifest = nlohmann::json::parse(in);
  }
  ASSERT_EQ(manifest["consumed_samples"].get<int64_t>(), 32) << manifest.dump();
  manifest["format_version"] = 1;
  manifest.erase("manifest_xxh3");
  manifest["consumed_samples"] = 16;  // Consistently, where the sampler records it too.
  ASSERT_EQ(manifest["sampler"]["consumed_samples"].get<int64_t>(), 32) << manifest.dump();
  manifest["sampler"]["consumed_samples"] = 16;
  std::ofstream(manifest_path) << manifest.dump(2);

  const std::string resume = common + " --train_iters=3 --load=" + dir + "/ckpt";
  EXPECT_EQ(testing::RunCommand(resume, &output), 2) << output;
  EXPECT_NE(output.find("format_version 1 predates manifest checksums"), std::string::npos)
      << output;
  EXPECT_NE(output.find("--allow_unchecksummed_manifest"), std::string::npos) << output;
  EXPECT_EQ(output.find("iteration 3"), std::string::npos) << "no training may start: " << output;

  EXPECT_EQ(testing::RunCommand(resume + " --allow_unchecksummed_manifest", &output), 0) << output;
  EXPECT_NE(output.find("consumed samples 16"), std::string::npos) << output;
}

// A Hugging Face round trip on the command line (fulcrum_ckpt export-hf, import-hf), then
// --finetune from the import: refused without the flag and with another model shape, run
// from iteration 0 with it (NOTE [finetune]).
TEST(TrainCliTest, FinetuneFromAnImportedCheckpoint) {
  const std::string dir = testing::MakeTempDir("cli_finetune");
  const std::string ckpt_tool = std::string(FULCRUM_BIN_DIR) + "/fulcrum_ckpt";
  const std::string common = kTrain + " --recipe=llama_tiny --num_layers=2 --eval_interval=0 --log_interval=1";
  std::string output;
  ASSERT_EQ(testing::RunCommand(common + " --train_iters=2 --save=" + dir + "/ckpt", &output), 0)
      << output;
  ASSERT_EQ(testing::RunCommand(ckpt_tool + " export-hf " + dir + "/ckpt " + dir + "/hf", &output), 0)
      << output;
  EXPECT_NE(output.find("exported LlamaForCausalLM"), std::string::npos) << output;
  ASSERT_EQ(testing::RunCommand(ckpt_tool + " import-hf " + dir + "/hf " + dir + "/imported", &output),
            0)
      << output;

  const std::string load = common + " --train_iters=2 --load=" + dir + "/imported";
  EXPECT_EQ(testing::RunCommand(load, &output), 2) << output;
  EXPECT_NE(output.find("add --finetune"), std::string::npos) << output;
  EXPECT_EQ(testing::RunCommand(load + " --finetune --hidden_size=64", &output), 2) << output;
  EXPECT_NE(output.find("(--hidden_size)"), std::string::npos) << output;
  EXPECT_EQ(testing::RunCommand(load + " --finetune", &output), 0) << output;
  EXPECT_NE(output.find("fine-tuning from the weights of"), std::string::npos) << output;
  EXPECT_NE(output.find("iteration      1/2"), std::string::npos) << output;

  EXPECT_EQ(testing::RunCommand(common + " --train_iters=2 --finetune", &output), 2) << output;
  EXPECT_NE(output.find("--finetune needs --load"), std::string::npos) << output;
}

// The same for Mixtral (mixtral_tiny): a trained MoE checkpoint does not record its top-k,
// which export-hf then needs as --num_experts_per_tok.
TEST(TrainCliTest, MixtralRoundTripAndFinetune) {
  const std::string dir = testing::MakeTempDir("cli_mixtral");
  const std::string ckpt_tool = std::string(FULCRUM_BIN_DIR) + "/fulcrum_ckpt";
  const std::string common =
      kTrain + " --recipe=mixtral_tiny --num_layers=2 --eval_interval=0 --log_interval=1";
  std::string output;
  ASSERT_EQ(testing::RunCommand(common + " --train_iters=2 --save=" + dir + "/ckpt", &output), 0)
      << output;
  const std::string do_export = ckpt_tool + " export-hf " + dir + "/ckpt " + dir + "/hf";
  EXPECT_EQ(testing::RunCommand(do_export, &output), 2) << output;
  EXPECT_NE(output.find("--num_experts_per_tok"), std::string::npos) << output;
  ASSERT_EQ(testing::RunCommand(do_export + " --num_experts_per_tok=2", &output), 0) << output;
  EXPECT_NE(output.find("exported MixtralForCausalLM"), std::string::npos) << output;
  ASSERT_EQ(testing::RunCommand(ckpt_tool + " import-hf " + dir + "/hf " + dir + "/imported", &output),
            0)
      << output;
  EXPECT_NE(output.find("--moe_router=mixtral"), std::string::npos) << output;
  EXPECT_EQ(testing::RunCommand(common + " --train_iters=2 --finetune --load=" + dir + "/imported",
                                &output),
            0)
      << output;
  EXPECT_NE(output.find("fine-tuning from the weights of"), std::string::npos) << output;
}

// Pre-emption (NOTE [graceful stop]): SIGTERM to a training run — one process, and a pp=2
// job through fulcrum_launch — ends it after the iteration in progress, saves that
// iteration, and exits 0 with a line saying so.
TEST(SlowTrainCliTest, SigtermSavesTheIterationInProgressAndExitsZero) {
  for (const int n : {1, 2}) {
    const std::string dir = testing::MakeTempDir("cli_sigterm");
    const std::string metrics = dir + "/m.jsonl";
    const std::string train = testing::TrainCommand(
        n, "--recipe=tiny --train_iters=100000 --eval_interval=0 --log_interval=1 --save=" + dir +
               "/ckpt --metrics_file=" + metrics +
               (n == 2 ? " --pipeline_model_parallel_size=2 --pipeline_schedule=zbh1" : ""));
    // Signal once three iterations are logged; report the exit code.
    const std::string script =
        "(" + train + ") > " + dir + "/out.txt 2>&1 & pid=$!; "
        "for i in $(seq 600); do [ -f " + metrics + " ] && [ $(wc -l < " + metrics +
        ") -ge 3 ] && break; sleep 0.1; done; kill -TERM $pid; wait $pid; echo exit=$?";
    std::string output;
    ASSERT_EQ(testing::RunCommand("/bin/sh -c '" + script + "'", &output), 0) << output;
    std::ifstream out_file(dir + "/out.txt");
    const std::string log((std::istreambuf_iterator<char>(out_file)), std::istreambuf_iterator<char>());
    EXPECT_NE(output.find("exit=0"), std::string::npos) << output << log;
    const std::vector<nlohmann::json> records = ReadMetrics(metrics);
    ASSERT_GE(records.size(), 3u) << log;
    const int64_t last = records.back()["iteration"].get<int64_t>();
    EXPECT_LT(last, 100000);
    EXPECT_NE(log.find("stopped at iteration " + std::to_string(last)), std::string::npos) << log;
    // The checkpoint is of the last iteration trained, complete and verified.
    std::ifstream latest(dir + "/ckpt/latest");
    std::string name;
    latest >> name;
    char expected[32];
    std::snprintf(expected, sizeof(expected), "iter_%07lld", static_cast<long long>(last));
    EXPECT_EQ(name, expected) << log;
    EXPECT_EQ(testing::RunCommand(std::string(FULCRUM_BIN_DIR) + "/fulcrum_ckpt verify " + dir + "/ckpt",
                                  &output),
              0)
        << output;
  }
}

// A data set with a 258-token vocabulary: tp=2 divides it even without padding, and 259
// is refused naming the padded vocabulary.
TEST(SlowTrainCliTest, UnpaddedVocabularyDivisibleByTpIsAccepted) {
  const std::string dir = testing::MakeTempDir("cli_vocab");
  auto writer = data::IndexedDatasetWriter::Create(dir + "/corpus", data::DType::kInt32);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (int64_t d = 0; d < 8; ++d) {
    std::vector<int64_t> tokens;
    for (int64_t t = 0; t < 300; ++t) tokens.push_back((d * 31 + t * 7) % 258);
    ASSERT_TRUE((*writer)->AddDocument(tokens).ok());
  }
  ASSERT_TRUE((*writer)->Finalize().ok());
  const std::string flags = " --data_path=" + dir + "/corpus --make_vocab_size_divisible_by=1 "
                            "--num_layers=1 --train_iters=1 --eval_interval=0 --seq_length=32 "
                            "--split=100,0,0 --tensor_model_parallel_size=2";
  std::string output;
  EXPECT_EQ(testing::RunCommand(testing::TrainCommand(2, flags + " --vocab_size=258"), &output), 0)
      << output;
  EXPECT_EQ(testing::RunCommand(testing::TrainCommand(2, flags + " --vocab_size=259"), &output), 2)
      << output;
  EXPECT_NE(output.find("the padded vocabulary (259) is not divisible by "
                        "--tensor_model_parallel_size=2"),
            std::string::npos)
      << output;
}

}  // namespace
}  // namespace fulcrum
