// fulcrum_sim through its binary: --case=all prints the DynMo table (DynMo's six cases,
// freezing twice; every case from the measured profiles built in), every figure labelled
// simulated; bad flags and bad traces exit 2 with one line naming the value, before any
// work; --output is written only by a run that succeeded, and never onto an input.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/dynamic/sim/hand_trace.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"

namespace fulcrum {
namespace {

using ::testing::HasSubstr;

const std::string kSim = std::string(FULCRUM_BIN_DIR) + "/fulcrum_sim";

std::string SimTemp(const std::string& name) {
  static const std::string dir = testing::MakeTempDir("sim_cli");  // one per test process
  return dir + "/" + name;
}

// Writes `lines` (a trace of hand-written lines) to a temporary file; returns its path.
std::string WriteTrace(const std::string& name, const std::vector<nlohmann::json>& lines) {
  const std::string path = SimTemp(name);
  std::ofstream out(path);
  for (const nlohmann::json& line : lines) out << line.dump() << "\n";
  return path;
}

// Exit code 2 and exactly one line of output, which contains `expected`.
void ExpectRefusedInOneLine(const std::string& args, const std::string& expected) {
  std::string output;
  EXPECT_EQ(testing::RunCommand(kSim + " " + args, &output), 2) << args << "\n" << output;
  EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << args << "\n" << output;
  EXPECT_NE(output.find(expected), std::string::npos) << args << "\n" << output;
}

TEST(SimCliTest, CaseAllPrintsTheDynmoTable) {
  std::string output;
  ASSERT_EQ(testing::RunCommand(kSim + " --case=all --iterations=10 --repack", &output), 0) << output;
  EXPECT_NE(output.find("SIMULATED"), std::string::npos) << output;
  const size_t table = output.find("DynMo table");
  ASSERT_NE(table, std::string::npos) << output;
  for (const char* name :
       {"moe", "moe_calibrated", "pruning", "freezing", "freezing_free", "sparse_attention",
        "early_exit", "mod"}) {
    const size_t row = output.find(std::string("\n  ") + name + " ", table);
    ASSERT_NE(row, std::string::npos) << name << "\n" << output;
    const std::string line = output.substr(row + 3, output.find('\n', row + 3) - row - 3);
    EXPECT_NE(line.find("idle"), std::string::npos) << line;
    EXPECT_NE(line.find("DynMo:"), std::string::npos) << line;
    EXPECT_NE(line.find("GPUs"), std::string::npos) << line;
    // NOTE [three numbers]: S_bal with the oracle's bound, S_dyn, S_total, and which of
    // them DynMo's figure compares to; MoE has no dense counterpart.
    for (const char* field : {"S_bal", "(bound", "S_dyn", "S_total", "tok/s/GPU", "compare: S_"}) {
      EXPECT_NE(line.find(field), std::string::npos) << field << ": " << line;
    }
    double s_bal = 0, bound = 0;
    ASSERT_EQ(std::sscanf(line.c_str() + line.find("S_bal"), "S_bal %lfx (bound %lfx)", &s_bal, &bound), 2)
        << line;
    EXPECT_GT(s_bal, 0.9) << line;
    EXPECT_GE(bound, 0.99) << "the oracle is at least the static placement: " << line;
    EXPECT_EQ(line.find("S_dyn   -") != std::string::npos,
              std::string(name).substr(0, 3) == "moe")
        << line;
  }
}

// --schedules: the four schedules side by side, figures labelled simulated. At unit costs
// ZB-V's bubble is below ZB-H1's and interleaved 1F1B's below 1F1B's (their closed forms:
// pipeline/chunked_schedule_test.cc); ZB-V holds 1F1B's p stage micro-batches.
TEST(SimCliTest, SchedulesComparesTheFourSchedules) {
  std::string output;
  ASSERT_EQ(testing::RunCommand(kSim + " --schedules --stages=4 --microbatches=8", &output), 0)
      << output;
  EXPECT_NE(output.find("SIMULATED"), std::string::npos) << output;
  EXPECT_NE(output.find("== 4 stages, 8 micro-batches"), std::string::npos) << output;
  // Row "  NAME  v | unit makespan bubble% | ms bubble% | activations".
  auto row = [&](const std::string& name) {
    const size_t at = output.find("\n  " + name + " ");
    EXPECT_NE(at, std::string::npos) << name << "\n" << output;
    return at == std::string::npos ? std::string() : output.substr(at + 1, output.find('\n', at + 1) - at - 1);
  };
  auto unit_bubble = [](const std::string& line) {
    const size_t bar = line.find('|');
    double makespan = 0, bubble = 0;
    std::sscanf(line.c_str() + bar + 1, "%lf %lf", &makespan, &bubble);
    return bubble;
  };
  const std::string one_f_one_b = row("1F1B"), h1 = row("ZB-H1"),
                    interleaved = row("interleaved 1F1B"), v = row("ZB-V");
  // At p = 4, m = 8, unit costs: 1F1B 3m + 3(p-1) = 33, bubble 9/33; ZB-V 6m + p - 1 = 51
  // chunk steps = 25.5 stage steps, bubble 1.5/25.5.
  EXPECT_NE(one_f_one_b.find("33.00   27.27%"), std::string::npos) << one_f_one_b;
  EXPECT_NE(v.find("25.50    5.88%"), std::string::npos) << v;
  EXPECT_LT(unit_bubble(v), unit_bubble(h1)) << v << "\n" << h1;
  EXPECT_LT(unit_bubble(interleaved), unit_bubble(one_f_one_b)) << interleaved;
  EXPECT_NE(v.rfind("| 4.00"), std::string::npos) << v;

  // Interleaved 1F1B needs m % p == 0: said in its row, the others still run.
  ASSERT_EQ(testing::RunCommand(kSim + " --schedules --stages=4 --microbatches=6", &output), 0)
      << output;
  EXPECT_NE(row("interleaved 1F1B").find("not run: 1f1b schedule: interleaved 1F1B"),
            std::string::npos)
      << output;
  EXPECT_NE(row("ZB-V").find("%"), std::string::npos) << output;

  ExpectRefusedInOneLine("--schedules --trace=" + SimTemp("none.jsonl"), "give exactly one of");
  ExpectRefusedInOneLine("--schedules --output=" + SimTemp("schedules.jsonl"),
                         "--output is not written by --schedules");
}

// --schedules --case: each case under the four schedules, uniform and balanced. Freezing's
// frozen front is a lasting imbalance every balancer must cut (asserted); the MoE rows are
// printed with their figures (at 4 stages and 20 iterations its noisy loads do not pay for
// the moves; NOTE [rebalance hysteresis]).
TEST(SimCliTest, SchedulesWithCasesBalanceUnderEverySchedule) {
  std::string output;
  ASSERT_EQ(testing::RunCommand(kSim + " --schedules --case=moe,freezing --stages=4 --iterations=20",
                                &output),
            0)
      << output;
  for (const char* header : {"== moe at 4 stages: 16 layers, 16 micro-batches",
                             "== freezing at 4 stages: 16 layers, 16 micro-batches"}) {
    EXPECT_NE(output.find(header), std::string::npos) << header << "\n" << output;
  }
  const std::string freezing = output.substr(output.find("== freezing"));
  // Row "  NAME  v | uniform ms bubble% | partition ms bubble% moved | diffusion ... | ratio".
  auto figures = [&](const std::string& name) {
    const size_t at = freezing.find("\n  " + name + " ");
    EXPECT_NE(at, std::string::npos) << name << "\n" << freezing;
    std::vector<double> out;
    if (at == std::string::npos) return out;
    const std::string line = freezing.substr(at + 1, freezing.find('\n', at + 1) - at - 1);
    std::string rest = line.substr(line.find('|') + 1);
    for (char& c : rest) {
      if (c == '|' || c == '%') c = ' ';
    }
    std::istringstream in(rest);
    double value = 0;
    while (in >> value) out.push_back(value);
    EXPECT_EQ(out.size(), 9u) << line;
    return out;
  };
  for (const auto& [name, bound] : std::vector<std::pair<std::string, double>>{
           {"1F1B", 0.8}, {"ZB-H1", 0.8}, {"interleaved 1F1B", 0.95}, {"ZB-V", 0.99}}) {
    const std::vector<double> f = figures(name);
    if (f.size() != 9) continue;
    const double uniform = f[0], partition = f[2], partition_moved = f[4], ratio = f[8];
    EXPECT_GT(partition_moved, 0) << name << ": the frozen layers must move";
    EXPECT_LT(partition, uniform) << name;
    EXPECT_LT(ratio, bound) << name;
    EXPECT_NEAR(ratio, std::min(partition, f[5]) / uniform, 1e-3) << name;
  }
}

TEST(SimCliTest, BadFlagsExitTwoNamingTheValue) {
  std::string output;
  EXPECT_EQ(testing::RunCommand(kSim + " --case=bogus", &output), 2);
  EXPECT_NE(output.find("--case=bogus"), std::string::npos) << output;
  EXPECT_EQ(testing::RunCommand(kSim, &output), 2);
  EXPECT_EQ(testing::RunCommand(kSim + " --trace=/nonexistent/trace.jsonl", &output), 2);
  EXPECT_NE(output.find("/nonexistent/trace.jsonl"), std::string::npos) << output;
  EXPECT_EQ(testing::RunCommand(kSim + " --case=moe --strategies=fastest", &output), 2);
  EXPECT_NE(output.find("fastest"), std::string::npos) << output;
}

// Traces that crashed the simulator (an uncaught JSON exception, or per-layer vectors indexed
// past their end) and measurements it accepted although no run can produce them.
TEST(SimCliTest, BadTracesExitTwoInOneLineNamingTheLine) {
  const std::vector<std::pair<std::function<void(nlohmann::json*)>, std::string>> cases = {
      {[](nlohmann::json* j) { j->erase("ran_on"); }, ":2: no 'ran_on'"},
      {[](nlohmann::json* j) {
         for (const char* f : {"layer_forward_ms", "layer_backward_ms", "layer_weight_ms"}) {
           (*j)["loads"][1][f] = nlohmann::json::array();
         }
       },
       ":2: stage 1's load has 0 layer_forward_ms"},
      {[](nlohmann::json* j) { (*j)["ran_on"] = {{0, 1}, {1, 5}}; }, ":2: 'ran_on' is not a placement"},
      {[](nlohmann::json* j) { (*j)["loads"] = {{{"stage", "zero"}}}; }, ":2: load trace:"},
      {[](nlohmann::json* j) { (*j)["measured"]["pipeline_ms"] = -30.0; }, ":2: measured pipeline_ms = -30"},
      {[](nlohmann::json* j) { (*j)["measured"]["iteration_ms"] = -33.0; }, ":2: measured iteration_ms = -33"},
      {[](nlohmann::json* j) { (*j)["schedule"] = "gpipe"; }, "schedule 'gpipe'"},
  };
  int k = 0;
  for (const auto& [edit, message] : cases) {
    nlohmann::json second = dynamic::HandTraceLine(2);
    edit(&second);
    if (second["schedule"] == "gpipe") {  // One schedule per trace: both lines.
      nlohmann::json first = dynamic::HandTraceLine(1);
      first["schedule"] = "gpipe";
      ExpectRefusedInOneLine("--trace=" + WriteTrace("bad" + std::to_string(k++), {first, second}),
                             message);
      continue;
    }
    const std::string path = WriteTrace("bad" + std::to_string(k++), {dynamic::HandTraceLine(1), second});
    ExpectRefusedInOneLine("--trace=" + path, path + message);
  }
}

TEST(SimCliTest, NumericFlagsOutOfRangeExitTwoInOneLine) {
  const std::string trace = "--trace=" + WriteTrace("flags", {dynamic::HandTraceLine(1)});
  for (const std::string flag :
       {"--p2p_bandwidth_gbps=0", "--p2p_bandwidth_gbps=-1", "--p2p_bandwidth_gbps=nan",
        "--migration_bandwidth_gbps=0", "--p2p_latency_us=-1", "--migration_latency_us=inf",
        "--p2p_bytes=-2", "--stages=-1", "--microbatches=-4", "--repack_slack=-0.5",
        "--rebalance_min_gain=nan", "--rebalance_interval=0", "--rebalance_window=0",
        "--scale_layers=-48", "--iterations=2"}) {
    ExpectRefusedInOneLine(trace + " " + flag, flag.substr(0, flag.find('=')));
  }
  ExpectRefusedInOneLine("--case=moe --device_tflops=0", "--device_tflops=0");
  ExpectRefusedInOneLine("--case=moe --vocab=-1", "--vocab=-1");
  ExpectRefusedInOneLine(trace + " --stages=5", "3 layers cannot fill 5 stages");
  ExpectRefusedInOneLine("--case=pruning --stages=1000", "cannot fill 1000 stages");
}

// --stages without --microbatches: the micro-batch count is the one the case or trace implies
// at the NEW stage count (a case's 4 per stage; a trace's micro-batches per stage, rounded
// up), not the one of the stage count it was built with. --microbatches still wins.
TEST(SimCliTest, StagesRescalesTheImpliedMicrobatchCount) {
  auto stage_lines = [](const std::string& args) {
    std::string output;
    EXPECT_EQ(testing::RunCommand(kSim + " " + args, &output), 0) << args << "\n" << output;
    return output;
  };
  // The cases' own layouts: 24 stages (pruning) and 16 (mod), 4 micro-batches per stage.
  std::string out = stage_lines("--case=pruning,mod --iterations=3");
  EXPECT_THAT(out, HasSubstr("24 stages, 48 layers, 96 micro-batches"));
  EXPECT_THAT(out, HasSubstr("16 stages, 32 layers, 64 micro-batches"));
  out = stage_lines("--case=pruning,mod --iterations=3 --stages=8");
  EXPECT_THAT(out, HasSubstr("8 stages, 48 layers, 32 micro-batches"));
  EXPECT_THAT(out, HasSubstr("8 stages, 32 layers, 32 micro-batches"));
  out = stage_lines("--case=pruning --iterations=3 --stages=8 --microbatches=10");
  EXPECT_THAT(out, HasSubstr("8 stages, 48 layers, 10 micro-batches"));
  // The hand trace ran 2 stages with 2 micro-batches: 1 per stage.
  const std::string trace =
      "--trace=" + WriteTrace("stages", {dynamic::HandTraceLine(1), dynamic::HandTraceLine(2),
                                         dynamic::HandTraceLine(3)});
  EXPECT_THAT(stage_lines(trace), HasSubstr("2 stages, 3 layers, 2 micro-batches"));
  EXPECT_THAT(stage_lines(trace + " --stages=3"), HasSubstr("3 stages, 3 layers, 3 micro-batches"));
  EXPECT_THAT(stage_lines(trace + " --stages=3 --microbatches=5"),
              HasSubstr("3 stages, 3 layers, 5 micro-batches"));
}

TEST(SimCliTest, MetricsWithAStringForACountExitTwo) {
  const std::string moe = SimTemp("moe.jsonl"), exits = SimTemp("exits.jsonl");
  std::ofstream(moe) << "{\"iteration\":1,\"expert_tokens\":{\"layers.0\":[\"many\",2]}}\n";
  std::ofstream(exits) << "{\"iteration\":1,\"early_exit_tokens\":{\"layers.0\":[\"x\",2,0]}}\n";
  ExpectRefusedInOneLine("--case=moe --moe_metrics=" + moe, moe + ":1: expert_tokens");
  ExpectRefusedInOneLine("--case=early_exit --early_exit_metrics=" + exits, exits + ":1: early_exit_tokens");
  const std::string prune = SimTemp("prune.jsonl");
  std::ofstream(prune) << "{\"iteration\":1,\"sparsity\":0.5,\"prune_target_sparsity\":0.5,"
                          "\"prune_layer_density\":{\"layers.0\":\"half\"}}\n";
  ExpectRefusedInOneLine("--case=pruning --prune_metrics=" + prune, prune + ":1: prune_layer_density");
}

// The pruning and freezing cases print one row per phase under their own (issue 25: per
// phase and end to end), each with the three numbers; a pruning run from --prune_metrics
// replaces the compiled-in profile and says so.
TEST(SimCliTest, PhasedCasesPrintARowPerPhase) {
  std::string output;
  ASSERT_EQ(testing::RunCommand(kSim + " --case=pruning,freezing --iterations=20", &output), 0) << output;
  const size_t table = output.find("DynMo table");
  ASSERT_NE(table, std::string::npos) << output;
  const std::string rows = output.substr(table);
  for (const char* phase : {"dense", "52% pruned", "79% pruned", "89% pruned", "90% pruned",
                            "none frozen", "freezing", "40 frozen"}) {
    const size_t at = rows.find(std::string("\n    ") + phase + " ");
    ASSERT_NE(at, std::string::npos) << phase << "\n" << rows;
    const std::string line = rows.substr(at + 1, rows.find('\n', at + 1) - at - 1);
    for (const char* field : {"idle", "S_bal", "(bound", "S_dyn", "S_total", "(iterations"}) {
      EXPECT_THAT(line, HasSubstr(field)) << phase;
    }
  }
  // The phase rows come after their case's row, in order.
  EXPECT_LT(rows.find("\n  pruning "), rows.find("\n    dense ")) << rows;
  EXPECT_LT(rows.find("\n    52% pruned"), rows.find("\n    90% pruned")) << rows;
  EXPECT_LT(rows.find("\n    90% pruned"), rows.find("\n  freezing ")) << rows;
  EXPECT_THAT(output, HasSubstr("tools/profiles/prune.jsonl"));

  const std::string prune = SimTemp("two_layers.jsonl");
  std::ofstream(prune) << "{\"iteration\":3,\"sparsity\":0.9,\"prune_target_sparsity\":0.9,"
                          "\"prune_layer_density\":{\"layers.0\":0.2,\"layers.1\":0.0}}\n";
  ASSERT_EQ(testing::RunCommand(kSim + " --case=pruning --iterations=10 --prune_metrics=" + prune, &output), 0)
      << output;
  EXPECT_THAT(output, HasSubstr(prune + " (2 layers;"));
  EXPECT_THAT(output, HasSubstr("80.0%..100.0%"));
}

TEST(SimCliTest, OutputIsNeverAnInput) {
  const std::string trace = WriteTrace("input.jsonl", {dynamic::HandTraceLine(1), dynamic::HandTraceLine(2)});
  const std::string before = testing::ReadFileBytes(trace);
  ExpectRefusedInOneLine("--trace=" + trace + " --output=" + trace, "refusing to overwrite");
  // Another spelling of the same file.
  const std::string dir = trace.substr(0, trace.rfind('/'));
  const std::string other = dir + "/./" + trace.substr(trace.rfind('/') + 1);
  ExpectRefusedInOneLine("--trace=" + trace + " --output=" + other, "refusing to overwrite");
  EXPECT_EQ(testing::ReadFileBytes(trace), before);
  ExpectRefusedInOneLine("--trace=" + trace + " --output=" + SimTemp("no/such/dir/out.jsonl"),
                         "does not exist");
  ExpectRefusedInOneLine("--trace=" + trace + " --output=" + dir, "is a directory");
}

TEST(SimCliTest, OutputOnlyFromARunThatSucceeded) {
  const std::string out = SimTemp("out.jsonl");
  std::ofstream(out) << "the previous run's results\n";
  nlohmann::json broken = dynamic::HandTraceLine(1);
  broken.erase("decision");
  ExpectRefusedInOneLine("--trace=" + WriteTrace("broken", {broken}) + " --output=" + out,
                         "no 'decision'");
  EXPECT_EQ(testing::ReadFileBytes(out), "the previous run's results\n");
  EXPECT_FALSE(std::ifstream(out + ".tmp").good());

  const std::string trace = WriteTrace("good", {dynamic::HandTraceLine(1), dynamic::HandTraceLine(2)});
  std::string output;
  ASSERT_EQ(testing::RunCommand(kSim + " --trace=" + trace + " --strategies=uniform,partition-time "
                                "--output=" + out, &output), 0) << output;
  std::istringstream lines(testing::ReadFileBytes(out));
  std::string line;
  int count = 0;
  while (std::getline(lines, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    EXPECT_EQ(j.at("source"), "fulcrum_sim");
    ++count;
  }
  EXPECT_EQ(count, 4);  // Two strategies × two iterations.
  EXPECT_FALSE(std::ifstream(out + ".tmp").good());
}

}  // namespace
}  // namespace fulcrum
