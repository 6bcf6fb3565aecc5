// A JSON Schema (draft 2020-12 and the drafts before it, as OpenAI's structured outputs and Pydantic write them)
// compiled into the GrammarProgram that generates exactly the values it describes, or refused with a message
// that says where and why.
//
// What is taken:
//  - type (one or a list), enum, const, anyOf / oneOf (alternatives that begin with different bytes; consts and
//    enums among them merge, and integer beside number is number; objects among them, a union of object models,
//    are told apart by their first property, which each must begin with and require: its key, or where several
//    share the key, its const or enum value, no value in two; or where first properties do not tell them apart, by
//    the first property they all require with such values, or else by each one's first required property where no
//    two share its key, which each then writes first), allOf of one schema,
//    $ref within the document ("#/$defs/...", "#/definitions/...", "#", recursion included), true and {} (any JSON
//    value).
//  - objects: properties, generated in the order written, the required ones always and the others where the
//    model writes them; required; additionalProperties, which beside properties is taken as false (the listed
//    properties only, as OpenAI's strict mode and llama.cpp do, which the schema allows whatever it says); an
//    object without properties is any object, or with additionalProperties a schema, an object of any keys with
//    values of that schema.
//  - arrays: items, minItems, maxItems, and tuples (Pydantic's Tuple[...]): prefixItems, then items for the rest
//    (false: none; left out: any value), or draft 7's items as a list, then additionalItems; uniqueItems where the
//    items are an enum's values (or consts, or booleans; at most 64: Pydantic's Set[Color]). Strings: minLength,
//    maxLength (in code points; an escape counts one), or pattern (src/engine/pattern_dfa.h), not beside them.
//    Integers: minimum, maximum, exclusiveMinimum, exclusiveMaximum, at most 18 digits. Numbers: the same bounds;
//    a number with bounds is written without an exponent in at most 15 digits, kept within them digit by digit
//    (compared exactly as decimals, so that a validator reading the answer as a double agrees).
//  - format on a string with no pattern or length bounds: date, time and date-time (RFC 3339, with an offset),
//    uuid and ipv4 are written to the letter (FormatPattern in json_schema.cc); other formats are annotations, as
//    draft 2020-12 has them by default.
//  - annotations (title, description, default, examples, ...) and unknown keywords are left alone.
// What is refused (InvalidArgument "at '<JSON pointer>': ..."): the keywords that assert what cannot be generated
// this way (multipleOf, not, if/then/else, uniqueItems of other items, contains, min/max properties,
// patternProperties, propertyNames, dependent*, unevaluated*), number bounds that no such number meets, patterns
// that pattern_dfa.h refuses, anyOf alternatives that can begin with the same byte (objects apart: above) and
// objects of a union that cannot be told apart by a property, $ref outside the document, schemas past the limits
// below, and schemas none of whose values nests at most kMaxGrammarDepth objects and arrays deep (a required
// property that recurses without end).
#pragma once

#include <cstddef>
#include <string_view>

#include "absl/status/statusor.h"
#include "src/engine/grammar_program.h"

namespace odmoe {

// The longest schema text a request may carry, and the deepest nesting of schemas inside it.
inline constexpr size_t kMaxSchemaBytes = 64 * 1024;
inline constexpr int kMaxSchemaNesting = 64;

// `schema`: JSON text; its objects' keys are read in the order written. InvalidArgument when it is not JSON, not
// a schema, or not one odmoe can generate (see above); the message reads after the schema's name: "is not JSON:
// ...", "has N bytes, at most ...", "at '/properties/a': 'multipleOf' is not supported".
absl::StatusOr<GrammarProgram> CompileJsonSchema(std::string_view schema);

}  // namespace odmoe
