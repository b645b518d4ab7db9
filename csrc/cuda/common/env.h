// Env-var switches of the CUDA host code (implementation choices that
// benchmarks and tests flip without rebuilding).
#pragma once
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace flash_attn_ext {
namespace cuda {

// Index of the env var's value in `values`; unset or empty reads as values[0].
// Anything else is an error that lists the choices.
inline int env_choice(const char* env_name, std::initializer_list<const char*> values) {
  const char* raw = std::getenv(env_name);
  if (raw == nullptr || raw[0] == '\0') return 0;
  int index = 0;
  std::string choices;
  for (const char* value : values) {
    if (std::strcmp(raw, value) == 0) return index;
    if (index > 0) choices += index + 1 == static_cast<int>(values.size()) ? " or " : ", ";
    choices += value;
    ++index;
  }
  throw std::runtime_error(std::string("flash_attn_ext: ") + env_name + " must be " + choices +
                           ", got '" + raw + "'");
}

}  // namespace cuda
}  // namespace flash_attn_ext
