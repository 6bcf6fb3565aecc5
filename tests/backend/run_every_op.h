// RunEveryOp: every Device op once, on fixed inputs, for tests that compare backends bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "src/backend/device.h"

namespace odmoe {

// Runs every op once on `device` with fixed inputs (uploaded through CopyToDevice) and returns each output's bytes.
std::vector<std::vector<uint8_t>> RunEveryOp(Device& device);

}  // namespace odmoe
