// ProtoToJson: a protobuf message as a JSON object, for the programs that print a message for people and
// scripts (`odmoe generate --json`'s stats, the workload bench's lines). One conversion, so that a field added
// to the .proto reaches every printout without a hand-kept list of keys.
//
// Differs from protobuf's own JSON mapping (util/json_util.h) where scripts need it: keys are the .proto field
// names; every field is present, a default value included; 64-bit integers are JSON numbers, not strings.
// Enums are their value names, bytes base64, nested messages objects, repeated fields arrays; a map field is an
// array of {key, value} objects. A NaN or infinite double becomes null when the JSON is dumped (nlohmann's rule).
#pragma once

#include "google/protobuf/message.h"
#include "src/common/json.h"

namespace odmoe {

Json ProtoToJson(const google::protobuf::Message& message);

}  // namespace odmoe
