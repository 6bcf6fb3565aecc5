#include "src/rpc/proto_json.h"

#include <string>

#include "absl/strings/escaping.h"
#include "google/protobuf/descriptor.h"

namespace odmoe {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// Element `index` of a repeated field, or the field itself when `index` is -1.
Json FieldValue(const Message& m, const Reflection& r, const FieldDescriptor& f, int index) {
  const bool rep = index >= 0;
  switch (f.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return rep ? r.GetRepeatedInt32(m, &f, index) : r.GetInt32(m, &f);
    case FieldDescriptor::CPPTYPE_INT64:
      return rep ? r.GetRepeatedInt64(m, &f, index) : r.GetInt64(m, &f);
    case FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r.GetRepeatedUInt32(m, &f, index) : r.GetUInt32(m, &f);
    case FieldDescriptor::CPPTYPE_UINT64:
      return rep ? r.GetRepeatedUInt64(m, &f, index) : r.GetUInt64(m, &f);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return rep ? r.GetRepeatedDouble(m, &f, index) : r.GetDouble(m, &f);
    case FieldDescriptor::CPPTYPE_FLOAT:
      return rep ? r.GetRepeatedFloat(m, &f, index) : r.GetFloat(m, &f);
    case FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r.GetRepeatedBool(m, &f, index) : r.GetBool(m, &f);
    case FieldDescriptor::CPPTYPE_ENUM: {
      const auto* value = rep ? r.GetRepeatedEnum(m, &f, index) : r.GetEnum(m, &f);
      return value->name();
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string s = rep ? r.GetRepeatedString(m, &f, index) : r.GetString(m, &f);
      if (f.type() == FieldDescriptor::TYPE_BYTES) return absl::Base64Escape(s);
      return s;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ProtoToJson(rep ? r.GetRepeatedMessage(m, &f, index) : r.GetMessage(m, &f));
  }
  return nullptr;  // not reached: the switch covers every CppType
}

}  // namespace

Json ProtoToJson(const Message& message) {
  const auto* descriptor = message.GetDescriptor();
  const Reflection* reflection = message.GetReflection();
  Json out = Json::object();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor& field = *descriptor->field(i);
    if (field.is_repeated()) {
      Json values = Json::array();
      const int n = reflection->FieldSize(message, &field);
      for (int j = 0; j < n; ++j) values.push_back(FieldValue(message, *reflection, field, j));
      out[field.name()] = std::move(values);
    } else {
      out[field.name()] = FieldValue(message, *reflection, field, -1);
    }
  }
  return out;
}

}  // namespace odmoe
