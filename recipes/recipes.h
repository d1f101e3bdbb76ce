// Recipes: named presets of fulcrum_train flags (--recipe=NAME). A recipe sets flag
// defaults; flags given explicitly on the command line or in a --flagfile win.
// Add a recipe with one FULCRUM_REGISTER(Recipe, name, "help", Recipe{...}) in recipes.cc.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/registry.h"

namespace fulcrum {

struct Recipe {
  std::vector<std::pair<std::string, std::string>> flags;  // flag name → value
};

using RecipeRegistry = Registry<Recipe>;

}  // namespace fulcrum
