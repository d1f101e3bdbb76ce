// A name → factory registry with one-line help texts, for everything Fulcrum finds by
// name: recipes, learning-rate schedules, and later routers, balancers, schedules and
// plugins. Registering a name twice is a programming error and aborts at start-up.
//
//   FULCRUM_REGISTER(RecipeRegistry, tiny, "4-layer GPT that trains in about a minute", ...);
//
// Thread-safety: registration happens during static initialisation; lookups afterwards
// are read-only and safe from any thread.
#pragma once

#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fulcrum {

template <typename Value>
class Registry {
 public:
  struct Entry {
    std::string name;
    std::string help;
    Value value;
  };

  /// The process-wide instance for this value type.
  static Registry& Global() {
    static Registry* registry = new Registry();  // never destroyed: outlives static users
    return *registry;
  }

  /// Adds `name`; throws std::logic_error when it is already taken.
  void Register(const std::string& name, const std::string& help, Value value) {
    auto [it, inserted] = entries_.emplace(name, Entry{name, help, std::move(value)});
    if (!inserted) throw std::logic_error("registry: '" + name + "' is registered twice");
  }

  /// The entry called `name`, or nullptr.
  const Entry* Find(const std::string& name) const {
    auto it = entries_.find(name);
    return it == entries_.end() ? nullptr : &it->second;
  }

  /// All entries sorted by name.
  std::vector<const Entry*> List() const {
    std::vector<const Entry*> out;
    for (const auto& [name, entry] : entries_) out.push_back(&entry);
    return out;
  }

  /// "a, b, c": for error messages that list what exists.
  std::string Names() const {
    std::string out;
    for (const auto& [name, entry] : entries_) out += (out.empty() ? "" : ", ") + name;
    return out;
  }

 private:
  std::map<std::string, Entry> entries_;
};

namespace internal {
template <typename Value>
struct Registerer {
  Registerer(const std::string& name, const std::string& help, Value value) {
    Registry<Value>::Global().Register(name, help, std::move(value));
  }
};
}  // namespace internal
}  // namespace fulcrum

/// Registers `value` under `name` in Registry<ValueType> at static-initialisation time.
#define FULCRUM_REGISTER(ValueType, name, help, value)                                     \
  static ::fulcrum::internal::Registerer<ValueType> fulcrum_registerer_##name##_(#name, \
                                                                                    help, value)
