#pragma once
#include <string>

#include "common/error.h"

namespace dz {
void log(dz_log_level level, const std::string& msg);
template <typename... Args>
void log_info(Args&&... a) {
  log(DZ_LOG_INFO, cat(std::forward<Args>(a)...));
}
template <typename... Args>
void log_warn(Args&&... a) {
  log(DZ_LOG_WARN, cat(std::forward<Args>(a)...));
}
template <typename... Args>
void log_debug(Args&&... a) {
  log(DZ_LOG_DEBUG, cat(std::forward<Args>(a)...));
}
}  // namespace dz
